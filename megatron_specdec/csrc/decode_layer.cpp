// Decoding layers of a batch-1 chain in one parallel region (see decode_ops.h).
//
// Run as separate ops, each of a layer's four weight products forks and joins torch's threads,
// and between them the norms and the attention run while no weight streams; called a layer at a
// time from Python, a SmolLM2 step spent ~2 ms of its ~25 in the calls (Intel Xeon with AMX, 2
// cores). Here the threads stay in one region for a run of layers, each taking its share of
// every piece, with a barrier wherever the next piece reads all of the last. (Fetching the first
// 16 KiB of a thread's next share into L2 before each barrier changed nothing measurable there.)
// Every element is computed by its op's own arithmetic, so the output is bitwise the ops' one by
// one.
#include "decode_ops.h"

#include "skinny_gemm.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace specdec {
namespace {

// Thread t's share [begin, end) of n items, in whole units (a product's block width) but the
// last.
std::pair<int64_t, int64_t> share(int64_t n, int64_t unit, int t, int threads) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(units * t / threads * unit, n), std::min(units * (t + 1) / threads * unit, n)};
}

// y[r, j] += addend[r * ld_addend + j] for rows r < s and columns [begin, end): a thread's share
// of a bias (ld_addend 0) or a residual, added as at::Tensor::add_ adds it.
void add_rows(float* y, int64_t ldy, const float* addend, int64_t ld_addend, int64_t s,
              std::pair<int64_t, int64_t> cols) {
  for (int64_t r = 0; r < s; ++r) {
    for (int64_t j = cols.first; j < cols.second; ++j) y[r * ldy + j] += addend[r * ld_addend + j];
  }
}

// input_norm, qkv_weight, qkv_bias (or None), proj_weight, mlp_norm, fc1_weight, fc2_weight,
// hidden_norm (or None: an EAGLE3 first layer's norm of the hidden stream).
constexpr int64_t kWeightsPerLayer = 8;

// A product's weight: float32, or a 16-bit copy of float32 values (weight_memory.narrow_copy).
at::Tensor weight_of(const at::Tensor& w, int64_t out, int64_t in, const char* name) {
  const at::ScalarType t = w.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && w.dim() == 2 && w.size(0) == out &&
                  w.size(1) == in,
              "decode_layer: ", name, " must be float32 (or a float16 or bfloat16 copy) [", out, ", ", in, "], got ",
              t, " ", w.sizes());
  return w.contiguous();
}

SkinnyOperands product_of(const at::Tensor& x, int64_t ldx, int64_t rows, const at::Tensor& w, at::Tensor& y) {
  return {x.data_ptr<float>(), ldx, rows, w.const_data_ptr(), w.size(1), w.size(1), y.data_ptr<float>(), w.size(0),
          weight_kind(w, "decode_layer: a weight")};
}

at::Tensor norm_of(const at::Tensor& w, int64_t h, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == h, "decode_layer: ", name,
              " must be float32 [", h, "], got ", w.scalar_type(), " ", w.sizes());
  return w.contiguous();
}

// One layer's checked operands and buffers. `run` is called by every thread of the region.
// `embeds` (defined for an EAGLE3 first layer, with a hidden_norm): the attention reads
// [input_norm(embeds), hidden_norm(hidden)], 2H wide, and the residual is the hidden stream.
class LayerPlan {
 public:
  LayerPlan(const at::Tensor& hidden, const at::Tensor& embeds, const c10::List<c10::optional<at::Tensor>>& weights,
            int64_t offset, const double* eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
            const at::Tensor& values, int64_t first, int64_t heads, double scale, const int64_t* schedules,
            int threads)
      : s_(hidden.size(0)),
        h_(hidden.size(2)),
        x_(hidden.contiguous()),
        norm1_(norm_of(required(weights, offset, "input_norm"), h_, "input_norm")),
        qkv_w_(required(weights, offset + 1, "qkv_weight")),
        qkv_(at::empty({s_, 1, qkv_w_.size(0)}, x_.options())),
        attention_(qkv_, cos, sin, keys, values, first, heads, scale, threads),
        eps1_(static_cast<float>(eps[0])),
        eps2_(static_cast<float>(eps[1])),
        eps3_(static_cast<float>(eps[2])) {
    const c10::optional<at::Tensor> hidden_norm = weights.get(offset + 7);
    TORCH_CHECK(hidden_norm.has_value() == embeds.defined(),
                "decode_layer: a layer takes embeds exactly when it has a hidden_norm (an EAGLE3 first layer), got ",
                embeds.defined() ? "embeds" : "no embeds", " and ", hidden_norm.has_value() ? "a" : "no",
                " hidden_norm");
    if (embeds.defined()) {
      TORCH_CHECK(embeds.scalar_type() == at::kFloat && embeds.sizes() == hidden.sizes(),
                  "decode_layer: embeds must be float32 ", hidden.sizes(), " like hidden, got ", embeds.scalar_type(),
                  " ", embeds.sizes());
      embeds_ = embeds.contiguous();
      norm3_ = norm_of(*hidden_norm, h_, "hidden_norm");
    }
    in_ = embeds.defined() ? 2 * h_ : h_;
    const int64_t qkv_out = qkv_w_.size(0), att_width = heads * attention_.d;
    qkv_w_ = weight_of(qkv_w_, qkv_out, in_, "qkv_weight");
    const c10::optional<at::Tensor> bias = weights.get(offset + 2);
    if (bias.has_value()) bias_ = norm_of(*bias, qkv_out, "qkv_bias");
    proj_w_ = weight_of(required(weights, offset + 3, "proj_weight"), h_, att_width, "proj_weight");
    norm2_ = norm_of(required(weights, offset + 4, "mlp_norm"), h_, "mlp_norm");
    const at::Tensor fc1_in = required(weights, offset + 5, "fc1_weight");
    TORCH_CHECK(fc1_in.dim() == 2 && fc1_in.size(0) % 2 == 0,
                "decode_layer: fc1_weight must be [2F, H] (gate and up rows), got ", fc1_in.sizes());
    f_ = fc1_in.size(0) / 2;
    fc1_w_ = weight_of(fc1_in, 2 * f_, h_, "fc1_weight");
    fc2_w_ = weight_of(required(weights, offset + 6, "fc2_weight"), h_, f_, "fc2_weight");
    const auto options = x_.options();
    normed_ = at::empty({s_, in_}, options);
    att_ = at::empty({s_, att_width}, options);
    mid_ = at::empty({s_, h_}, options);
    normed2_ = at::empty({s_, h_}, options);
    up_ = at::empty({s_, 2 * f_}, options);
    act_ = at::empty({s_, f_}, options);
    out_ = at::empty({s_, 1, h_}, options);
    qkv_op_ = product_of(normed_, in_, s_, qkv_w_, qkv_);
    proj_op_ = product_of(att_, att_width, s_, proj_w_, mid_);
    fc1_op_ = product_of(normed2_, h_, s_, fc1_w_, up_);
    fc2_op_ = product_of(act_, f_, s_, fc2_w_, out_);
    const char* names[4] = {"qkv_weight", "proj_weight", "fc1_weight", "fc2_weight"};
    const at::Tensor* products[4] = {&qkv_w_, &proj_w_, &fc1_w_, &fc2_w_};
    for (int i = 0; i < 4; ++i) {
      check_skinny_schedule(schedules[i], "decode_layer");
      schedule_[i] = schedules[i];
      width_[i] = skinny_block_width(schedules[i]);
      // Threads split a product in whole panels (fc1: its gate and up halves alike).
      const int64_t split = i == 2 ? f_ : products[i]->size(0);
      TORCH_CHECK(schedules[i] != kSkinnyPanel || (split % kSkinnyPanelWidth == 0 && products[i]->size(1) % 16 == 0),
                  "decode_layer: ", names[i], " ", products[i]->sizes(), " read as packed panels (schedule 3) needs ",
                  i == 2 ? "each half's rows" : "its rows", " a multiple of ", kSkinnyPanelWidth,
                  " and its columns of 16");
    }
  }

  const at::Tensor& output() const { return out_; }
  int64_t scratch_size() const { return attention_.scratch_size(); }

  // Thread t of n_threads: its share of the layer.
  void run(int t, int n_threads, float* scratch) const {
    const float* x = x_.data_ptr<float>();
    const auto rows = share(s_, 1, t, n_threads);
    if (embeds_.defined()) {
      float* normed = normed_.data_ptr<float>();
      for (int64_t r = rows.first; r < rows.second; ++r) {
        rms_norm_rows(embeds_.data_ptr<float>() + r * h_, norm1_.data_ptr<float>(), eps1_, h_, normed + r * in_, 0,
                      1);
        rms_norm_rows(x + r * h_, norm3_.data_ptr<float>(), eps3_, h_, normed + r * in_ + h_, 0, 1);
      }
    } else {
      rms_norm_rows(x, norm1_.data_ptr<float>(), eps1_, h_, normed_.data_ptr<float>(), rows.first, rows.second);
    }
#pragma omp barrier
    const int64_t qkv_out = qkv_op_.ldy;
    const auto q = share(qkv_out, width_[0], t, n_threads);
    skinny_share(qkv_op_, q.first, q.second, schedule_[0]);
    if (bias_.defined()) add_rows(qkv_op_.y, qkv_out, bias_.data_ptr<float>(), 0, s_, q);
    // The cache lines this thread's attention reads, requested before the barriers: the
    // weights streamed since the last step have evicted them, and met one miss at a time they
    // made an 8-token chain's attention a fifth slower (AMD EPYC Zen 5, perf).
    const auto tasks = share(attention_.tasks(), 1, t, n_threads);
    attention_.prefetch_cache(tasks.first, tasks.second);
#pragma omp barrier
    const auto slots = share(s_ * attention_.groups, 1, t, n_threads);
    for (int64_t item = slots.first; item < slots.second; ++item) attention_.write_slot(item);
#pragma omp barrier
    for (int64_t task = tasks.first; task < tasks.second; ++task) {
      attention_.attend_task(task, scratch, att_.data_ptr<float>());
    }
#pragma omp barrier
    const auto o = share(h_, width_[1], t, n_threads);
    skinny_share(proj_op_, o.first, o.second, schedule_[1]);
    float* mid = mid_.data_ptr<float>();
    add_rows(mid, h_, x, h_, s_, o);
#pragma omp barrier
    rms_norm_rows(mid, norm2_.data_ptr<float>(), eps2_, h_, normed2_.data_ptr<float>(), rows.first, rows.second);
#pragma omp barrier
    // A thread's gate rows and their up rows: the gated SiLU of its columns needs no barrier.
    const auto g = share(f_, width_[2], t, n_threads);
    skinny_share(fc1_op_, g.first, g.second, schedule_[2]);
    skinny_share(fc1_op_, f_ + g.first, f_ + g.second, schedule_[2]);
    const float* up = up_.data_ptr<float>();
    float* act = act_.data_ptr<float>();
    for (int64_t r = 0; r < s_; ++r) {
      silu_mul_span(up + r * 2 * f_ + g.first, up + r * 2 * f_ + f_ + g.first, act + r * f_ + g.first,
                    g.second - g.first);
    }
#pragma omp barrier
    const auto d = share(h_, width_[3], t, n_threads);
    skinny_share(fc2_op_, d.first, d.second, schedule_[3]);
    add_rows(out_.data_ptr<float>(), h_, mid, h_, s_, d);
  }

 private:
  static at::Tensor required(const c10::List<c10::optional<at::Tensor>>& weights, int64_t i, const char* name) {
    const c10::optional<at::Tensor> w = weights.get(i);
    TORCH_CHECK(w.has_value(), "decode_layer: ", name, " is required, got None");
    return *w;
  }

  int64_t s_, h_, f_ = 0, in_ = 0;
  at::Tensor x_, norm1_, qkv_w_, qkv_;
  ChainAttention attention_;
  float eps1_, eps2_, eps3_;
  at::Tensor embeds_, norm3_, bias_, proj_w_, norm2_, fc1_w_, fc2_w_;
  at::Tensor normed_, att_, mid_, normed2_, up_, act_, out_;
  SkinnyOperands qkv_op_{}, proj_op_{}, fc1_op_{}, fc2_op_{};
  int64_t schedule_[4] = {}, width_[4] = {};
};

}  // namespace

std::vector<at::Tensor> decode_layers_cpu(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                                          at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                                          at::TensorList keys, at::TensorList values, int64_t first,
                                          at::IntArrayRef heads, at::ArrayRef<double> scale, at::IntArrayRef schedules,
                                          at::IntArrayRef capture, const c10::optional<at::Tensor>& embeds) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(values.size()) == layers,
              "decode_layers: keys and values must hold one cache per layer (at least one), got ", keys.size(),
              " and ", values.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers,
              "decode_layers: weights must hold ", kWeightsPerLayer,
              " per layer (input_norm, qkv_weight, qkv_bias or None, proj_weight, mlp_norm, fc1_weight, fc2_weight, "
              "hidden_norm or None), "
              "got ", weights.size(), " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(heads.size()) == layers && static_cast<int64_t>(scale.size()) == layers,
              "decode_layers: heads and scale must hold one value per layer, got ", heads.size(), " and ",
              scale.size(), " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == 3 * layers,
              "decode_layers: eps must hold 3 per layer (input, MLP and hidden norms), got ", eps.size(), " for ",
              layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(schedules.size()) == 4 * layers,
              "decode_layers: schedules must hold 4 per layer (QKV, output, fc1, fc2), got ", schedules.size(),
              " for ", layers, " layers");
  for (int64_t c : capture) {
    TORCH_CHECK(c >= 0 && c < layers, "decode_layers: capture holds layer ", c, ", expected 0 .. ", layers - 1);
  }
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 3 && hidden.size(1) == 1,
              "decode_layers: hidden must be float32 [s, 1, H] (one sequence's chain), got ", hidden.scalar_type(),
              " ", hidden.sizes());
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<LayerPlan> plans;
  plans.reserve(layers);
  for (int64_t i = 0; i < layers; ++i) {
    plans.emplace_back(i == 0 ? hidden : plans.back().output(),
                       i == 0 && embeds.has_value() ? *embeds : at::Tensor(), weights, kWeightsPerLayer * i,
                       eps.data() + 3 * i, cos, sin, keys[i], values[i], first, heads[i], scale[i],
                       schedules.data() + 4 * i, threads);
  }
  int64_t scratch_size = 0;
  for (const LayerPlan& plan : plans) scratch_size = std::max(scratch_size, plan.scratch_size());
  std::vector<float> scratch(static_cast<size_t>(threads) * scratch_size);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    float* own = scratch.data() + static_cast<size_t>(t) * scratch_size;
    for (int64_t i = 0; i < layers; ++i) {
      plans[i].run(t, n_threads, own);
#pragma omp barrier
    }
  }
  std::vector<at::Tensor> outputs;
  for (int64_t c : capture) outputs.push_back(plans[c].output());
  outputs.push_back(plans.back().output());
  return outputs;
}

}  // namespace specdec
