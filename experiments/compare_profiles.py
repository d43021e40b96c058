"""Two parsed train-step profiles side by side, by kind of work (issue 26: k3jax vs jla's trainer).

  python -m experiments.compare_profiles --profiles=experiments/results/profile_1b_like_for_like_h200.json,\
experiments/results/profile_1b_like_for_like_h200_jla.json --names=k3jax,jla \
      --out=experiments/results/profile_1b_like_for_like_vs_jla_h200

Input: `experiments/profile_step.py` JSONs (a k3jax run, or `--from_trace` on a peer's trace). Each op row
goes to the first category (`CATEGORIES`) whose rule matches its kernel name, HLO kind or source line;
kernels inside XLA command buffers carry no HLO metadata, so custom kernels are recognised by name.
Writes <out>.md and <out>.json: ms per step per category and system, and the difference to the first.
"""
from __future__ import annotations

import collections
import json
import re

from absl import app, flags

from experiments.harness import write_results

# (category, rule on "kernel | kind | source | component"), first match wins.
CATEGORIES = (
    # the kernels (cuDNN's sdpa, jla's entry / kernel_dq / kernel_dkv) and the ops of the attention functions;
    # the layers' projections and reshapes are GEMMs or glue, as in every other sublayer
    ("softmax attention",
     r"sdpa|flash_[bf]prop|^kernel_dq_|^kernel_dkv_|^entry_mosaic_gpu|flash_attention|causal_attention"),
    ("KDA kernels (chunked scan)", r"^(kda_|vg_)"),
    ("KDA short conv", r"short_conv|short_causal_conv"),
    ("MoE grouped GEMM", r"^body_mosaic_gpu_kernel|ragged_dot|grouped_matmul\.py"),
    ("dense GEMM (cuBLAS / XLA)", r"^nvjet|^gemm_fusion|^cutlass|cublas|\| dot \|"),
    ("MoE routing, permute, combine", r"moe|token_dispatch|routing|balancing|quantile"),
    # k3jax's norms are flax's RMSNorm: their innermost k3jax frame is the scanned sublayer that calls it
    ("norms", r"rms_?norm|norm\.py|_scan_stack\.<locals>\.sublayer"),
    ("optimizer", r"optax|optimizer"),
    ("memcpy / memset", r"^Memcpy|^Memset|memcpy|memset"),
)
OTHER = "everything else"


def category(row: dict) -> str:
    """The category of one profile_step op row."""
    text = " | ".join(str(row.get(k, "")) for k in ("kernel", "kind", "source", "component"))
    for name, rule in CATEGORIES:
        if re.search(rule, text, flags=re.IGNORECASE):
            return name
    return OTHER


def by_category(profile: dict) -> dict[str, float]:
    """ms per step of each category in one profile_step result's "profile"."""
    acc: dict[str, float] = collections.defaultdict(float)
    for row in profile["ops"]:
        acc[category(row)] += row["ms_per_step"]
    return dict(acc)


def compare(paths: list[str], names: list[str]) -> dict:
    """Per-category ms per step of each profile, plus each one's step wall and device-busy time."""
    if len(paths) != len(names) or len(paths) < 2:
        raise ValueError(f"need >= 2 profiles and one name each; got {paths=}, {names=}")
    systems = []
    for path, name in zip(paths, names):
        with open(path) as f:
            result = json.load(f)
        p = result["profile"]
        systems.append({"name": name, "path": path, "date": result.get("env", {}).get("date", ""),
                        "step_wall_ms": p["step_wall_ms"], "device_busy_ms": p["device_busy_ms"],
                        "categories": by_category(p)})
    return {"systems": systems, "categories": [c for c, _ in CATEGORIES] + [OTHER]}


def render(result: dict) -> str:
    systems = result["systems"]
    head = [s["name"] for s in systems]
    lines = ["# Train step by kind of work: " + " vs ".join(head), "",
             "`experiments/compare_profiles.py` on " + ", ".join(f"`{s['path']}` ({s['date']})" for s in systems) + ".",
             "ms per step; Δ = each system minus the first. Categories by kernel name, HLO kind and source line "
             "(`CATEGORIES` in the script).", "",
             "| kind of work | " + " | ".join(head) + " | " + " | ".join(f"Δ {h}" for h in head[1:]) + " |",
             "|---|" + "---|" * (2 * len(head) - 1)]
    rows = [("step wall", [s["step_wall_ms"] for s in systems]),
            ("device busy", [s["device_busy_ms"] for s in systems])]
    rows += [(c, [s["categories"].get(c, 0.0) for s in systems]) for c in result["categories"]]
    for label, values in rows:
        deltas = [v - values[0] for v in values[1:]]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " | "
                     + " | ".join(f"{d:+.1f}" for d in deltas) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    result = compare(_PROFILES.value, _NAMES.value)
    text = render(result)
    write_results(_OUT.value, result, text)
    print(text)


if __name__ == "__main__":
    _PROFILES = flags.DEFINE_list("profiles", [], "profile_step JSONs, the reference first.")
    _NAMES = flags.DEFINE_list("names", [], "One name per profile.")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_compare_profiles/compare", "Output prefix (<out>.json, <out>.md).")
    app.run(main)
