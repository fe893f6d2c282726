// Limits and error codes shared by the C++ and CUDA acceptance ops (plain C++, no torch).
#pragma once

namespace specdec {

// Longest draft chain (K) the ops accept; the CUDA kernels keep per-request
// state for this many positions in shared memory.
constexpr long kMaxDraftLen = 64;
// Largest draft tree (N nodes) the ops accept, for the same reason.
constexpr long kMaxTreeNodes = 256;

// Value errors the CUDA kernels report through a device flag (the first one wins);
// the launcher turns them into TORCH_CHECK messages.
enum ValueError : int {
  kOk = 0,
  kBadLogit = 1,      // NaN or +inf in a target logit (after temperature)
  kEmptyRow = 2,      // every logit of a row is -inf
  kBadDraftProb = 3,  // NaN, inf or negative draft probability
  kBadId = 4,         // a token id outside [0, V) (the launchers check ids first)
};

}  // namespace specdec
