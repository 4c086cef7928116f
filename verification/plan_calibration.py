"""fgpu plan against TorchTitan's published Llama 3.1 throughput and memory.

Rows: verification/data/published_torchtitan.csv (each with its source; ``split`` is fit, heldout
or unsupported: a configuration the planner does not model yet, printed but not scored).  Each
row is planned as ``fgpu plan`` plans it: the TorchTitan config (llama3 ``llama3_8b`` /
``llama3_70b`` / ``llama3_405b``, the row's parallelism, batch, AC, compile, Float8 and
schedule) on cluster_configs/h100-96gb-500w-grand-teton-8gpu-rdma.yaml repeated to the row's
GPUs.

    python verification/plan_calibration.py [--rows 1,3] [--json OUT]

Prints published vs predicted tokens/s per GPU and peak memory, the error per row, the median
|error| of fit and held-out rows, and whether each table's predicted order is its published one.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "verification" / "data" / "published_torchtitan.csv"
CLUSTER = ROOT / "cluster_configs" / "h100-96gb-500w-grand-teton-8gpu-rdma.yaml"
CONFIGS = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}


def rows(path: Path = DATA) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def titan_args(row: dict) -> list[str]:
    args = ["--module", "llama3", "--config", CONFIGS[row["model"]],
            "--parallelism.data_parallel_shard_degree", row["dp_shard"],
            "--parallelism.tensor_parallel_degree", row["tp"],
            "--parallelism.pipeline_parallel_degree", row["pp"],
            "--parallelism.context_parallel_degree", row["cp"],
            "--parallelism.pipeline_parallel_schedule", row["schedule"],
            "--training.local_batch_size", row["local_batch"],
            "--training.seq_len", row["seq_len"]]
    if int(row["pp"]) > 1:       # TorchTitan 0.3.0 refuses CUDA graphs with pipeline parallelism
        args += ["--training.disable_cuda_graphs"]
        # TorchTitan of 2024-12 split the local batch into as many micro-batches as pipeline
        # stages by default (its pipeline_parallel_microbatches); 0.3.0 sets a micro-batch size
        microbatches = int(row["pp"])
        args += ["--parallelism.pipeline_parallel_microbatch_size", str(int(row["local_batch"]) // microbatches)]
    args += ["--compile.enable" if row["compile"] == "1" else "--compile.no-enable"]
    args += ["--compile.enable_async_tensor_parallel" if row["async_tp"] == "1"
             else "--compile.no-enable_async_tensor_parallel"]
    return args


def plan_row(row: dict) -> dict:
    from fakegpu.cli.plan import _plan_isolated, _set_ac, _titan_config
    from fakegpu.topology import load_cluster_config

    config = _titan_config(titan_args(row), "h100-96gb")
    _set_ac(config, row["ac"])
    _loss_of_2024(config)
    _rope_of_2024(config)
    _attention_of_2024(config)
    # Each row in a forked child, as the sweep plans each layout: torch and TorchTitan keep
    # mesh and sharding state in module globals that one row's capture must not leave to the next.
    # float8_tp_gathers: TorchTitan of 2024-12 applied torchao's Float8 TP plans with Float8
    # (tensorwise), so the TP all-gathers feeding Float8 linears moved float8 (its
    # docs/float8.md: "float8 all-gather ... for TP (by default for Float8Linear)"); 0.3.0's
    # TP plans gather bf16.
    return _plan_isolated(config, int(row["gpus"]), load_cluster_config(str(CLUSTER)), True,
                          row["float8"] == "1", float8_tp_gathers=row["float8"] == "1")


def _loss_of_2024(config) -> None:
    """The published runs (TorchTitan of 2024-12) computed cross-entropy on the whole logits;
    TorchTitan 0.3.0's default chunks the output projection and the loss over the sequence,
    which holds far less memory. The rows are planned with the loss their software ran."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn if config.loss.loss_fn is not None else CrossEntropyLoss.Config()


def _rope_of_2024(config) -> None:
    """TorchTitan of 2024-12 sized the RoPE table to the training sequence; 0.3.0's llama3 specs
    stop at 131072 positions and refuse longer sequences (table 2's and 6's CP 8 rows)."""
    import dataclasses

    seq = int(config.training.seq_len)
    for layer in config.model_spec.model.layers:
        attention = getattr(layer, "attention", None)
        rope = getattr(attention, "rope", None)
        if rope is not None and rope.max_seq_len < seq:
            attention.rope = dataclasses.replace(rope, max_seq_len=seq)


def _attention_of_2024(config) -> None:
    """TorchTitan of 2024-12 ran SDPA (flex attention came later), and under context
    parallelism torch's SDPA ring attention; 0.3.0's llama3 specs build flex attention and
    refuse SDPA for language models.  The rows are planned with the attention their software
    ran: each layer's inner attention TorchTitan's ScaledDotProductAttention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.model_spec.model.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()


def run(selected: list[dict]) -> list[dict]:
    out = []
    for row in selected:
        result = dict(row)
        if row["split"] == "unsupported":
            out.append(result)
            continue
        t0 = time.time()
        p = plan_row(row)
        result.update(predicted_tps=p["tokens_per_second_per_gpu"], predicted_gib=p["peak_memory_reserved_gib"],
                      mfu=p["mfu"], step_seconds=p["step_seconds"], plan_seconds=round(time.time() - t0, 1))
        result["tps_error"] = result["predicted_tps"] / float(row["tokens_per_s_per_gpu"]) - 1
        result["memory_error"] = result["predicted_gib"] / float(row["memory_gib"]) - 1
        out.append(result)
        print(f"  table {row['table']} {row['row']:<34} {float(row['tokens_per_s_per_gpu']):>7,.0f} "
              f"{result['predicted_tps']:>7,.0f} {result['tps_error']:>+7.1%}   {float(row['memory_gib']):>5.1f} "
              f"{result['predicted_gib']:>5.1f} {result['memory_error']:>+7.1%}  {row['split']} "
              f"({result['plan_seconds']} s)", flush=True)
    return out


def summary(results: list[dict], split: str | None = None) -> dict:
    scored = [r for r in results if "tps_error" in r and (split is None or r["split"] == split)]
    if not scored:
        return {"rows": 0}
    tps = [abs(r["tps_error"]) for r in scored]
    mem = [abs(r["memory_error"]) for r in scored]
    order_ok = True
    for table in {r["table"] for r in scored}:
        rows_ = [r for r in scored if r["table"] == table]
        published = sorted(rows_, key=lambda r: float(r["tokens_per_s_per_gpu"]))
        predicted = sorted(rows_, key=lambda r: r["predicted_tps"])
        order_ok &= [r["row"] for r in published] == [r["row"] for r in predicted]
    return {"rows": len(scored), "median_tps_error": statistics.median(tps), "max_tps_error": max(tps),
            "median_memory_error": statistics.median(mem), "max_memory_error": max(mem),
            "table_order_kept": order_ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", help="comma-separated table numbers to run (default all)")
    p.add_argument("--json", help="write the per-row results here")
    a = p.parse_args(argv)
    selected = rows()
    if a.rows:
        wanted = {t.strip() for t in a.rows.split(",") if t.strip()}
        tables = sorted({r["table"] for r in selected}, key=int)
        unknown = sorted(wanted - set(tables))
        if unknown or not wanted:
            p.error(f"--rows {a.rows!r}: no table {', '.join(unknown) or '(none given)'} in {DATA.name}; "
                    f"its tables are {', '.join(tables)}")
        selected = [r for r in selected if r["table"] in wanted]
    print(f"  {'row':<42} {'pub':>7} {'pred':>7} {'error':>7}   {'GiB':>5} {'pred':>5} {'error':>7}")
    results = run(selected)
    for split in ("fit", "heldout", None):
        print(f"{split or 'all'}: {json.dumps(summary(results, split))}")
    for r in results:
        if r["split"] == "unsupported":
            print(f"  not modeled: table {r['table']} {r['row']} ({r['source']})")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
