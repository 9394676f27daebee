"""The issue-#15 benchmarks run at tiny scale (their real runs are recorded under bench/results/): the
acceptance benchmark through the engine, the seed-bug capture comparison, and the benchmark-only
capture itself (a model keyword no spec or CLI reaches)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MT-bench and HumanEval in the files bench/real_data.py writes (two questions each)."""
    d = tmp_path_factory.mktemp("real-data")
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku about the sea.", "Now make it rhyme."]},
            {"question_id": 82, "category": "coding", "turns": ["Reverse a list in Python.", "Explain it."]}]
    (d / "mt_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"},
                {"task_id": "HumanEval/1", "prompt": "def is_even(n):\n    \"\"\"True if n is even.\"\"\"\n"}]
    with gzip.open(d / "HumanEval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems)
    return d


def _bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, f"bench/{script}", *args], check=False, capture_output=True, text=True,
                          timeout=900, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_spec_decode_real_tiny(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    proc = _bench("spec_decode_real.py", "--tiny", "--data-dir", str(data_dir), "--configs", "none,tree",
                  "--temperatures", "0,1", "--mtbench", "2", "--humaneval", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert {"date", "machine", "command", "numbers"} <= record.keys()
    numbers = record["numbers"]
    assert {k: v["identical"] == v["prompts"] for k, v in numbers["greedy_equal_to_no_speculation"].items()} == \
        {"none": True, "tree": True}
    chain = numbers["engine"]["tree@T=0"]
    assert [t["turn"] for t in chain["mtbench"]] == [1, 2] and len(chain["humaneval"]) == 1
    acc = chain["mtbench"][0]["acceptance"]
    assert acc["prompts"] == 2 and acc["drafts"] > 0 and 1.0 <= acc["acceptance_length"] <= 4.0
    assert "bootstrap_95" in acc and "per_prompt_std" in acc
    first = chain["mtbench"][0]
    assert abs(first["ms_per_round"] * acc["drafts"] / 1000 - first["seconds"]) <= 6e-4  # seconds: 3 decimals
    assert numbers["engine"]["none@T=0"]["humaneval"][0]["ms_per_round"] is None
    assert numbers["speedup_engine"]["tree@T=1"]["humaneval_turn1"]["speedup"] > 0


def test_spec_decode_real_interleaved_tiny(data_dir: Path, tmp_path: Path) -> None:
    """--interleave: both engines built first, each prompt through both in turn; paired speed-ups per set and turn,
    no second run of plain decoding, the second turn asked after each configuration's own first answer."""
    out = tmp_path / "record.json"
    proc = _bench("spec_decode_real.py", "--tiny", "--interleave", "--data-dir", str(data_dir), "--configs",
                  "none,chain-3", "--temperatures", "0", "--mtbench", "2", "--humaneval", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers = json.loads(out.read_text())["numbers"]
    assert sorted(numbers["engine"]) == ["chain-3@T=0", "none@T=0"]
    assert {k: v["identical"] == v["prompts"] for k, v in numbers["greedy_equal_to_no_speculation"].items()} == \
        {"none": True, "chain-3": True}
    paired = numbers["paired_speedup_engine"]["chain-3@T=0"]
    assert sorted(paired) == ["humaneval_turn1", "mtbench_turn1", "mtbench_turn2"]
    row = paired["mtbench_turn1"]
    assert row["prompts"] == 2 and row["bootstrap_95"][0] <= row["speedup"] <= row["bootstrap_95"][1]
    engine = numbers["engine"]
    pooled = engine["none@T=0"]["mtbench"][0]["seconds"] / engine["none@T=0"]["mtbench"][0]["tokens"] / (
        engine["chain-3@T=0"]["mtbench"][0]["seconds"] / engine["chain-3@T=0"]["mtbench"][0]["tokens"])
    assert abs(row["speedup"] - pooled) < 0.01 * pooled + 0.002  # per-prompt seconds: 4 decimals


def test_seed_bug_capture_tiny(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    proc = _bench("seed_bug_capture.py", "--tiny", "--data-dir", str(data_dir), "--mtbench", "2", "--humaneval", "2",
                  "--max-new-tokens", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers = json.loads(out.read_text())["numbers"]
    for name in ("mtbench", "humaneval"):
        row = numbers[name]
        assert row["same_tokens"]  # greedy verification is exact: only acceptance may differ
        assert row["complete"]["prompts"] == row["before_completion"]["prompts"] == 2
        assert row["before_completion_vs_complete"]["prompts"] == 2


def _aux(rank: int, world: int, backend: str, model_dir: str) -> dict[str, Any]:
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.verify import VerifyOptions, _engine_config, _prefill_step
    from fusedserve.worker.parallel.rank import build_rank

    groups = build_groups(ParallelConfig(world), rank, backend)
    prompts = [[5, 9, 17, 3, 44, 8, 100], [7, 7, 1]]
    out = {}
    for capture in ("complete", "before_completion"):
        built = build_rank(model_dir, _engine_config(VerifyOptions(model=model_dir), prompts, torch.device("cpu")),
                           groups, backend, "reference", aux_layers=(2, 4, 5), aux_capture=capture)
        res = built.executor.run(_prefill_step(prompts))
        out[capture] = (res.logits, torch.cat(res.hidden, -1))
    return out


def test_before_completion_capture_reads_each_ranks_partial_sum(tmp_path: Path) -> None:
    from fusedserve.tiny import make_tiny_llama
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    model = str(make_tiny_llama(tmp_path / "m", num_hidden_layers=8))
    r0, r1 = run_on_ranks(_aux, 2, model)
    for r in (r0, r1):
        torch.testing.assert_close(r["complete"][0], r["before_completion"][0])  # the forward is the same
    torch.testing.assert_close(r0["complete"][1], r1["complete"][1])  # complete: the same on every rank
    assert not torch.allclose(r0["before_completion"][1], r1["before_completion"][1], atol=1e-3)  # partial sums
    assert not torch.allclose(r0["complete"][1], r0["before_completion"][1], atol=1e-3)


def test_the_benchmark_only_capture_is_reachable_from_no_spec_or_cli() -> None:
    for path in ("worker/spec.py", "fusedserve/cli.py", "worker/ray/rank_actor.py", "worker/engine/config.py",
                 "worker/spec_decode/config.py"):
        assert "aux_capture" not in (REPO_ROOT / path).read_text(), path
    from fusedserve.models.decoder_stack import check_aux_capture

    with pytest.raises(ValueError, match="aux_capture must be one of"):
        check_aux_capture("early")


def test_a_sync_configuration_reads_every_round_back() -> None:
    """``bench/spec_decode_real.py``'s ``+sync`` suffix: the same speculation, rounds read back one by one."""
    from bench.spec_decode_real import config_of, overlap_of

    assert config_of("chain-7+sync") == config_of("chain-7") == {"num_steps": 7}
    assert config_of("none+sync") is None and config_of("tree-s5-k4-t8+sync") == config_of("tree-s5-k4-t8")
    assert (overlap_of("chain-7+sync"), overlap_of("chain-7"), overlap_of("none")) == (False, None, None)
    with pytest.raises(KeyError):
        config_of("chain-7+fast")


def test_sharegpt_subset_passes_over_the_first_prompts_for_a_fresh_round() -> None:
    """``bench/real_data.py --sharegpt-skip``: the next regeneration round's prompts follow the last round's."""
    from bench.real_data import sharegpt_subset

    convs = [{"id": "gpt-first", "conversations": [{"from": "gpt", "value": "not a prompt"}]}]
    convs += [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                {"from": "gpt", "value": "answer"}]} for i in range(6)]
    raw = json.dumps(convs).encode()
    first = sharegpt_subset(raw, 3)
    after = sharegpt_subset(raw, 3, skip=3)
    assert [c["id"] for c in first] == ["c0", "c1", "c2"] and [c["id"] for c in after] == ["c3", "c4", "c5"]
    assert after[0]["conversations"] == [{"from": "human", "value": "question 3"}]
    assert sharegpt_subset(raw, 3, skip=5) == [{"id": "c5", "conversations": [{"from": "human", "value": "question 5"}]}]


def test_later_turns_are_packed_within_the_character_budget() -> None:
    """``bench/real_data.py``'s sharegpt-turns: conversations cut after their last later human turn that fits
    ``--turns-chars``; none without one; what `train-draft --turns later` reads back as prompts."""
    from bench.real_data import sharegpt_later_turns

    def conv(cid: str, *texts: str) -> dict[str, object]:
        return {"id": cid, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                             for i, t in enumerate(texts)]}

    raw = json.dumps([conv("one-turn", "q"), conv("short", "q1", "a1", "q2", "a2", "q3", "a3"),
                      conv("long", "q1", "a" * 30, "q2"), conv("cut", "q1", "a1", "q2", "x" * 30, "q3")]).encode()
    packed = sharegpt_later_turns(raw, max_chars=20)
    assert [c["id"] for c in packed] == ["short", "cut"]
    assert [t["value"] for t in packed[0]["conversations"]] == ["q1", "a1", "q2", "a2", "q3"]
    assert [t["value"] for t in packed[1]["conversations"]] == ["q1", "a1", "q2"]


def test_spec_host_time_runs_and_counts_forwards(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    proc = _bench("spec_host_time.py", "--temperatures", "1", "--steps", "3", "--tokens", "12", "--repeats", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["numbers"]
    assert [r["steps"] for r in rows] == [0, 3]
    assert rows[0]["forwards_per_round"] == pytest.approx(1.0, abs=0.1)  # a decode step a token
    assert 1.5 <= rows[1]["forwards_per_round"] <= 2.5  # first pass and chained draft steps in one, the verify
    assert all(r["host_ms_per_round_median"] > 0 for r in rows)


def test_spec_host_time_times_the_replays_host_path(tmp_path: Path) -> None:
    out = tmp_path / "replays.json"
    proc = _bench("spec_host_time.py", "--replays", "--steps", "3", "--calls", "20", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["numbers"]
    assert row["steps"] == 3 and row["verify_run_us"] > 0 and row["draft_run_first_chain_us"] > 0


def test_spec_host_time_times_whole_rounds_with_no_op_replays(tmp_path: Path) -> None:
    out = tmp_path / "noop.json"
    proc = _bench("spec_host_time.py", "--noop-rounds", "--steps", "3", "--tokens", "12", "--repeats", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["numbers"]
    assert [(r["temperature"], r["steps"], r["overlap"]) for r in rows] == [
        (t, s, o) for t in (0.0, 1.0) for s, o in ((0, False), (3, False), (3, True))]
    for plain, spec, in_flight in (rows[:3], rows[3:]):
        assert plain["rounds"] == 12 and 0 < spec["rounds"] <= 12 and 0 < in_flight["rounds"] <= 12
        assert min(row["us_per_round_median"] for row in (plain, spec, in_flight)) > 0


def test_spec_host_time_counts_the_ops_outside_the_replays(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = _bench("spec_host_time.py", "--op-counts", "--steps", "3", "--tokens", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["temperature"], r["steps"]): r for r in json.loads(out.read_text())["numbers"]}
    assert set(rows) == {(t, s) for t in (0.0, 1.0) for s in (0, 3)}
    assert all(r["ops_per_round"] > 0 for r in rows.values())
    assert rows[(1.0, 3)]["ops_per_round"] > rows[(0.0, 3)]["ops_per_round"]  # a sampled round does more on the host
    assert "speculator._restage" in rows[(1.0, 3)]["counted_as_launches"]  # the GPU's fast paths as their launches


def test_detokenize_time_times_pushes_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "detok.json"
    proc = _bench("detokenize_time.py", "--model", "examples/checkpoints/tiny-code", "--tokens", "120", "--repeats", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["numbers"]
    assert [r["tokens_per_push"] for r in rows] == [1, 3, 4, 8]
    assert all(r["us_per_push_direct"] > 0 and r["us_per_push_transformers"] > 0 for r in rows)


def test_output_handoff_runs_and_delivers_once_or_every_step(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    proc = _bench("output_handoff.py", "--tokens", "12", "--reps", "1", "--busy-us", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["host"]["cpus"] >= 1 and record["host"]["python_loop_ms"] > 0  # which host the run had
    rows = record["rows"]
    assert rows["final_only"]["deliveries"] == 1
    assert rows["streamed"]["deliveries"] >= 6  # a delivery per step (the consumer may merge a few)
    assert all(r["ms_per_token"] > 0 for r in rows.values())


def test_dropped_kernels_leave_their_step_and_unknown_kinds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.common.drop_kernels`` (decode_engine / graph_launch_probe --drop): the verify's split-attention
    combine and the several-token attention are replaced by no-ops (restored after the test), one-row decode
    attention kept; an unknown kind stops the bench before any engine is built."""
    import fusedserve.models.layers.decode_attention_triton as attention_module
    import fusedserve.models.layers.prefill_attention_triton as prefill_module
    from bench.common import drop_kernels

    for module, name in ((prefill_module, "combine_splits"), (attention_module, "paged_prefill_attention_triton"),
                         (attention_module, "paged_decode_attention_triton")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored when the test ends
    decode = attention_module.paged_decode_attention_triton
    assert drop_kernels("combine,multi_token_attention") == ["combine", "multi_token_attention"]
    q = torch.randn(8, 3, 4)
    assert prefill_module.combine_splits(q, q, q, q) is None
    assert attention_module.paged_prefill_attention_triton(q, q, q, 0, None, 1.0) is q
    assert attention_module.paged_decode_attention_triton is decode
    with pytest.raises(SystemExit, match="--drop takes"):
        drop_kernels("matmul")


def _probe_record(settings: dict[str, Any], plain_us: float, verify_us: float, steps: int,
                  machine: str = "1x NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    """A graph_launch_probe --timeline record, as much of it as bench/probe_table.py reads."""
    def config(replays: list[tuple[str, float]], n: int) -> dict[str, Any]:
        return {"engine_steps": n, "timeline": {"replays": [{"graph": g, "gpu_us": us} for g, us in replays]}}
    shape = "StepShape(batch=1, tokens={}, tail=0, last_only=False, hidden=0, chain={})"
    return {"machine": machine, "settings": settings, "dropped_kernels": [],
            "configs": {"none": config([("target " + shape.format(1, 0), plain_us)], 257),
                        "chain-7": config([("target " + shape.format(8, 0), verify_us),
                                           ("draft " + shape.format(8, 6), 250.0)], steps)}}


def test_probe_table_groups_alternated_variants_and_takes_medians(tmp_path: Path) -> None:
    """bench/probe_table.py over an alternated A/B (bench/gpu_real.sh probes): a variant's records grouped by
    what they set, each graph's median over them, the busy time against the first variant's, the engine
    steps kept per record; records of two machines are tabled but flagged."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import probe_table
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    on = {"models.layers.linear_triton.L2_PREFETCH_K_MAX": 2048}
    records = [_probe_record({}, 510.0, 790.0, 80), _probe_record(on, 512.0, 760.0, 80),
               _probe_record({}, 514.0, 792.0, 80), _probe_record(on, 508.0, 750.0, 81)]
    rows = probe_table.table(records)
    assert list(rows) == ["(defaults)", "models.layers.linear_triton.L2_PREFETCH_K_MAX=2048"]
    base, new = rows["(defaults)"], rows["models.layers.linear_triton.L2_PREFETCH_K_MAX=2048"]
    assert base["chain-7"]["graphs"]["target batch=1 tokens=8 chain=0"] == {
        "median_us": 791.0, "min_us": 790.0, "max_us": 792.0, "runs": 2}
    assert base["chain-7"]["busy_us"] == 1041.0 and new["chain-7"]["busy_us"] == 1005.0
    assert new["chain-7"]["busy_vs_first_us"] == -36.0 and new["chain-7"]["steps"] == [80, 81]
    assert new["none"]["busy_vs_first_us"] == -2.0
    paths = []
    for i, r in enumerate([*records, _probe_record({}, 500.0, 700.0, 80, machine="1x NVIDIA H200")]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    done = _bench("probe_table.py", *map(str, paths), "--out", str(tmp_path / "table.json"))
    assert done.returncode == 0, done.stderr
    assert "records of 2 machines" in done.stderr and "(defaults)" in done.stdout
    table = json.loads((tmp_path / "table.json").read_text())
    assert len(table["machines"]) == 2 and set(table["variants"]) == set(rows)


def test_decode_table_pairs_the_rounds_of_an_alternated_decode_ab(tmp_path: Path) -> None:
    """bench/decode_table.py over bench/decode_engine.py records (bench/gpu_real.sh decodes): a real tiny record
    (the keys the table reads), then variants alternated over two rounds: per batch the median step, the k-th run
    paired with the first variant's k-th, the roofline share at the records' median copy bandwidth."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import decode_table
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    real = tmp_path / "real.json"
    done = _bench("decode_engine.py", "--tiny", "--decode-only", "--no-peer", "--batches", "1,4", "--steps", "2",
                  "--set", "models.layers.linear_triton.ONE_TILE_SLICES=(64,8)", "--out", str(real))
    assert done.returncode == 0, done.stderr[-3000:]
    got = decode_table.table([json.loads(real.read_text())])
    assert list(got["variants"]) == ["models.layers.linear_triton.ONE_TILE_SLICES=[64, 8]"]  # JSON: a list
    assert set(next(iter(got["variants"].values()))) == {1, 4}

    def record(settings: dict[str, Any], bw: float, ms64: float) -> dict[str, Any]:
        gb = 4.0  # bytes a step: 4 GB -> 1 ms at 4 TB/s
        return {"machine": "1x NVIDIA H200", "settings": settings, "dropped_kernels": [],
                "ceilings": {"copy_bandwidth_TBps": bw},
                "decode": [{"batch": 64, "ms_per_step": ms64, "bytes_per_step": gb * 1e9,
                            "fraction_of_roofline": gb / bw / ms64}]}

    on = {"models.layers.linear_triton.ONE_TILE_SLICES": (64, 8)}
    records = [record({}, 4.0, 1.30), record(on, 4.2, 1.20), record({}, 4.1, 1.26), record(on, 4.0, 1.25)]
    rows = decode_table.table(records)
    assert rows["copy_bandwidth_TBps"] == pytest.approx(4.05)
    base, new = rows["variants"]["(defaults)"][64], rows["variants"][decode_table.variant_of(records[1])][64]
    assert base["ms_median"] == pytest.approx(1.28) and base["runs"] == 2 and base["vs_first_ms"] == 0.0
    assert new["vs_first_ms"] == pytest.approx(-0.055) and new["vs_first_runs"] == 2  # -0.10 and -0.01
    assert new["fraction_median_bw"] == pytest.approx(round(4.0 / 4.05 / 1.225, 4))
    assert new["fraction_own_bw"] == pytest.approx((4.0 / 4.2 / 1.20 + 4.0 / 4.0 / 1.25) / 2, abs=1e-4)
    paths = []
    for i, r in enumerate(records):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    done = _bench("decode_table.py", *map(str, paths), "--out", str(tmp_path / "table.json"))
    assert done.returncode == 0, done.stderr
    assert "(defaults)" in done.stdout and "-0.055 ms vs the first (2 paired)" in done.stdout
    assert json.loads((tmp_path / "table.json").read_text())["machines"] == ["1x NVIDIA H200"]


def test_marginal_kernel_times_count_overlap_once_and_idle_apart() -> None:
    """Under PDL a kernel starts before the one ahead ends: each kernel is charged from the previous end to its
    own, an idle gap goes to "(idle)", host events are left out, per call of ``reps``."""
    from types import SimpleNamespace

    from bench.common import marginal_times

    def event(name: str, start: float, end: float, device: str = "DeviceType.CUDA") -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)

    events = [event("b", 1, 5), event("a", 0, 3), event("c", 7, 9), event("a", 9, 12), event("host", 0, 99, "CPU")]
    assert marginal_times(events, reps=1) == {"a": 6.0, "b": 2.0, "(idle)": 2.0, "c": 2.0}
    assert marginal_times(events, reps=2) == {"a": 3.0, "b": 1.0, "(idle)": 1.0, "c": 1.0}


def test_kernel_sequence_is_the_middle_call_in_launch_order() -> None:
    """``kernel_sequence``: the middle of ``reps`` calls' kernels in launch order, each [name, duration,
    critical-path time], the latter charged from the latest end before it (the calls before it included), so an
    overlapped (PDL) kernel adds only what it runs past the one ahead; host events are left out."""
    from types import SimpleNamespace

    from bench.common import kernel_sequence

    def event(name: str, start: float, end: float, device: str = "DeviceType.CUDA") -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)

    calls = [[event("a", 10 * i, 10 * i + 3), event("b", 10 * i + 2, 10 * i + 6), event("c", 10 * i + 8, 10 * i + 9)]
             for i in range(3)]
    events = [e for call in reversed(calls) for e in call] + [event("host", 0, 99, "CPU")]
    assert kernel_sequence(events, reps=3) == [["a", 3, 3], ["b", 4, 3], ["c", 1, 1]]
    assert kernel_sequence(events, reps=1)[:4] == [["a", 3, 3], ["b", 4, 3], ["c", 1, 1], ["a", 3, 3]]
