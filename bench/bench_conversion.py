"""Conversion time and peak memory: SmolLM2-135M-Instruct HF -> Megatron at TP=1 and TP=2,
and back to HF. Each conversion runs as its own command-line process (TP=2 spawns 2 ranks);
peak memory is the largest total RSS of the process tree, and of its largest process (a rank).

    python bench/bench_conversion.py   # prints a table, writes bench/results/conversion.json
"""

import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_peak import measure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main():
    from megatron_specdec.default_model import default_model_dir

    hf_dir = default_model_dir()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            ckpt = Path(tmp) / f"tp{tp}"
            for direction, cmd in (
                    ("hf_to_megatron", ["checkpoint_tools/hf_to_megatron.py", "--hf_path", hf_dir,
                                        "--out", ckpt, "--tp", str(tp)]),
                    ("megatron_to_hf", ["checkpoint_tools/megatron_to_hf.py", "--ckpt", ckpt,
                                        "--out", Path(tmp) / f"hf{tp}"])):
                seconds, tree, one = measure([sys.executable, REPO / cmd[0], *cmd[1:]])
                rows.append({"direction": direction, "tp": tp, "seconds": seconds,
                             "peak_rss_mib": tree, "peak_rss_per_process_mib": one})
    print(f"{'direction':<16}{'TP':>4}{'seconds':>10}{'peak RSS MiB':>14}{'per process':>13}")
    for r in rows:
        print(f"{r['direction']:<16}{r['tp']:>4}{r['seconds']:>10.1f}{r['peak_rss_mib']:>14.0f}"
              f"{r['peak_rss_per_process_mib']:>13.0f}")
    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "cpus": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "note": "wall time includes process start-up and imports (~8 s per process)",
              "rows": rows}
    out = REPO / "bench" / "results" / "conversion.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
