"""fastckpt plan: the worked examples of docs/plan.md against hand-computed values, the tier
model, Young/Daly, the verdict and exit codes, and --from-run on a real run's event log."""

from __future__ import annotations

import json
import math
import re
import statistics
import time

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli, sizing
from fastckpt.cli._common import parse_bandwidth, parse_count, parse_duration, parse_size
from fastckpt.cli.runlog import profile
from fastckpt.eventlog import read_events
from tests.helpers import close_all

TB, GB = 1e12, 1e9


def invoke(*args: str):
    return CliRunner().invoke(cli, ["plan", *args])


# ---------------------------------------------------------------- units
@pytest.mark.parametrize("text, want", [("70B", 70e9), ("7e9", 7e9), ("1.5T", 1.5e12), ("350M", 350e6), ("12", 12)])
def test_counts(text: str, want: float) -> None:
    assert parse_count(text) == want


@pytest.mark.parametrize("text, want", [("1.4TB", 1.4e12), ("8MiB", 8 << 20), ("1GiB", 1 << 30), ("4096", 4096),
                                        ("2GB", 2e9)])
def test_sizes_are_si_unless_binary(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text, want", [("10GB/s", 10e9), ("2.5GiB/s", 2.5 * 2**30), ("400Gb/s", 50e9),
                                        ("400Gbps", 50e9), ("100 MB/s", 100e6)])
def test_bandwidths(text: str, want: float) -> None:
    assert parse_bandwidth(text) == want


@pytest.mark.parametrize("text, want", [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("60s", 60), ("500ms", 0.5),
                                        ("30d", 30 * 86400), ("45", 45)])
def test_durations(text: str, want: float) -> None:
    assert parse_duration(text) == want


@pytest.mark.parametrize("text", ["1.4", "1.4B", " 0.5 "])
def test_a_fraction_of_a_byte_is_refused_not_truncated(text: str) -> None:
    """``--state-size 1.4`` (a unit left out) was planned as a 1-byte checkpoint; a size with a
    unit is still rounded to the nearest byte."""
    with pytest.raises(ValueError, match=r"is a fraction of a byte: give whole bytes, or a unit \(e.g. [0-9.]+GB"):
        parse_size(text)
    assert parse_size("0.1GiB") == round(0.1 * 2**30) and parse_size("1.0B") == 1


@pytest.mark.parametrize("parse, text", [(parse_size, "8M"), (parse_size, "lots"), (parse_bandwidth, "10GB"),
                                         (parse_duration, "2 fortnights"), (parse_count, "70X")])
def test_unreadable_units_say_how_to_write_them(parse, text: str) -> None:
    with pytest.raises(ValueError, match="write e.g."):
        parse(text)


@pytest.mark.parametrize("text, want", [("400gbps", 50e9), ("400gb/s", 50e9), ("400Gbps", 50e9),
                                        ("400gbit/s", 50e9), ("400Gbit/s", 50e9), ("10gbps", 1.25e9),
                                        ("10Gib/s", 10 * 2**30 / 8), ("10GiB/s", 10 * 2**30), ("10gB/s", 10e9),
                                        ("10GBps", 10e9), ("800bps", 100)])
def test_a_lower_case_b_is_bits_whatever_the_prefix_case(text: str, want: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["10G/s", "10gi/s", "10ps", "10Gx/s"])
def test_a_bandwidth_without_b_or_bit_shows_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="400Gbps or 400Gbit/s"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text, fix", [("8Gb", "8GB"), ("8gib", "8GiB"), ("100b", "100B")])
def test_a_size_in_bits_is_refused_with_the_byte_spelling(text: str, fix: str) -> None:
    with pytest.raises(ValueError, match=f"in bits.*e.g. {fix}"):
        parse_size(text)


def test_bench_fabric_capacity_in_lower_case_bits(tmp_path) -> None:
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--size", "1MiB", "--block-size", "1MiB",
                                 "--workers", "1", "--buffered", "--fabric-capacity", "10gbps", "--json"])
    assert r.exit_code in (0, 1), r.output
    assert json.loads(r.stdout)["fabric_capacity_Bps"] == 1.25e9


@pytest.mark.parametrize("parse, text", [(parse_size, "1e400"), (parse_bandwidth, "1e400GB/s"),
                                         (parse_count, "1e400"), (parse_duration, "1e400h"), (parse_duration, "1e400")])
def test_a_value_too_large_to_be_finite_is_refused(parse, text: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        parse(text)


# ---------------------------------------------------------------- the worked examples
def test_70b_mixed_adam_is_1_12_tb() -> None:
    assert sizing.PRESETS["mixed-adam"][0] == 2 + 2 + 4 + 4 + 4
    assert sizing.state_bytes(70e9, 16) == pytest.approx(1.12 * TB)


def test_presets_bytes_per_param() -> None:
    assert {k: v[0] for k, v in sizing.PRESETS.items()} == {"mixed-adam": 16, "no-grads": 14, "weights-bf16": 2,
                                                            "fp8-adam": 11}


def test_1_4_tb_at_10_gbps_takes_140_s() -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.4 * TB, bandwidth_Bps=10 * GB))
    assert p.write_s == pytest.approx(140.0)


@pytest.mark.parametrize("budget_s, need", [(60, 20 * GB), (30, 40 * GB)])
def test_1_2_tb_in_60_or_30_s_needs_20_or_40_gbps(budget_s: float, need: float) -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.2 * TB, bandwidth_Bps=10 * GB, budget_s=budget_s, gpus=64))
    assert p.required_write_Bps == pytest.approx(need)
    assert p.required_write_Bps_per_node == pytest.approx(need / 8)


def test_every_2h_for_30_days_is_360_checkpoints_and_140_s_each_is_14_h() -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.4 * TB, bandwidth_Bps=10 * GB, interval_s=7200, days=30,
                                      gpus=1024, gpu_hour_cost=2.0))
    s = p.synchronous
    assert p.checkpoints == pytest.approx(360)
    assert s.campaign_stall_hours == pytest.approx(14.0)
    assert s.overhead_fraction == pytest.approx(140 / 7200)  # 1.94 %: within the 2 % budget
    assert s.passed
    assert s.campaign_gpu_hours_lost == pytest.approx(14.0 * 1024)
    assert s.campaign_cost_lost == pytest.approx(14.0 * 1024 * 2.0)


def test_state_per_node_and_per_gpu() -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=10 * GB, gpus=1024, gpus_per_node=8))
    assert (p.nodes, p.state_bytes_per_node, p.state_bytes_per_gpu) == (128, pytest.approx(8.75 * GB),
                                                                       pytest.approx(1.09375 * GB))


def test_a_job_that_does_not_fill_its_last_node_is_sized_by_a_full_node() -> None:
    """12 GPUs at 8 per node: one node holds 8/12 of the state, not half. Sized by the even split,
    its local tier and staging passed where a full node's missed."""
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=20 * GB, gpus=12, gpus_per_node=8,
                                      local_bandwidth_Bps=2 * GB, host_memory_bytes=1.2 * TB))
    full = 1.12 * TB * 8 / 12
    assert (p.nodes, p.state_bytes_per_node) == (2, pytest.approx(full))  # before: 560 GB
    assert p.fastckpt.local_write_s == pytest.approx(full / (2 * GB))
    assert p.required_write_Bps_per_node == pytest.approx(full / p.inputs.budget_s)
    assert not p.fastckpt.passed and "the staging buffers pin 746.7 GB per node" in p.fastckpt.problems[-1]
    even = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=20 * GB, gpus=16, gpus_per_node=8))
    assert even.state_bytes_per_node == pytest.approx(1.12 * TB / 2)  # whole nodes: state / nodes, as before


def test_one_node_and_one_gpu_are_singular() -> None:
    out = invoke("--params", "1B", "--gpus", "1", "--bandwidth", "1GB/s").output
    assert "per node (1 node)" in out and "per GPU (1 GPU)" in out and "1 nodes" not in out
    out = invoke("--params", "1B", "--gpus-per-node", "1", "--bandwidth", "1GB/s").output
    assert "one node of 1 GPU\n" in out and "1 GPUs" not in out
    out = invoke("--params", "1B", "--gpus", "16", "--bandwidth", "1GB/s").output
    assert "per node (2 nodes)" in out and "per GPU (16 GPUs)" in out


# ---------------------------------------------------------------- fastckpt's tiers
def test_fastckpt_stalls_for_the_snapshot_and_drains_in_the_background() -> None:
    # 1.12 TB on 1024 GPUs: 1.09375 GB per GPU at 20 GB/s is 0.0547 s of stall
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=10 * GB, gpus=1024,
                                      local_bandwidth_Bps=5 * GB, snapshot_bandwidth_Bps=20 * GB))
    f = p.fastckpt
    assert f.snapshot_s == pytest.approx(1.09375 / 20)
    assert f.local_write_s == pytest.approx(8.75 / 5)  # per node: 8.75 GB at 5 GB/s
    assert f.drain_s == pytest.approx(112.0)
    assert f.drain_required_Bps == pytest.approx(1.12 * TB / 7200)
    assert f.overhead_fraction == pytest.approx(f.snapshot_s / 7200)
    assert f.passed and p.passed


def test_a_drain_longer_than_the_interval_says_by_how_much_bandwidth_falls_short() -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.44 * TB, bandwidth_Bps=0.1 * GB, interval_s=3600, gpus=64))
    f = p.fastckpt
    assert f.drain_s == pytest.approx(14400)
    assert f.drain_shortfall_Bps == pytest.approx(0.4 * GB - 0.1 * GB)
    assert not f.passed and not p.passed
    assert any("falls short by 0.3 GB/s" in x for x in f.problems)
    assert any("0.4 GB/s" in x and "4 h" in x for x in f.advice)


def test_the_smallest_change_names_the_bandwidth_and_the_interval_that_meet_the_budget() -> None:
    p = sizing.plan(sizing.PlanInputs(state_bytes=1.4 * TB, bandwidth_Bps=1 * GB, interval_s=3600, gpus=64))
    s = p.synchronous
    assert not s.passed
    # 1400 s per checkpoint; 2 % of 3600 s is 72 s: 1400 / 72 = 19.44x
    assert "19.44 GB/s" in s.advice[0] and "19.44 h" in s.advice[0]
    assert "fastckpt stalls" in s.advice[1]  # the async tier meets it here


def test_young_daly_with_mtbf_per_node_or_per_job() -> None:
    per_node = sizing.plan(sizing.PlanInputs(state_bytes=1.4 * TB, bandwidth_Bps=10 * GB, gpus=64, mtbf_s=8 * 86400,
                                             mtbf_per="node"))
    per_job = sizing.plan(sizing.PlanInputs(state_bytes=1.4 * TB, bandwidth_Bps=10 * GB, gpus=64, mtbf_s=86400,
                                            mtbf_per="job"))
    assert per_node.job_mtbf_s == per_job.job_mtbf_s == 86400  # 8 nodes: a node's 8 days is the job's 1 day
    assert per_node.synchronous.young_daly_interval_s == pytest.approx(math.sqrt(2 * 140 * 86400))  # 4918.5 s
    assert per_node.synchronous.campaign_failures == pytest.approx(30)
    # each failure loses E[T | T < 2 h] for T ~ Exp(mean 1 day): 86400 - 7200 / (e^(1/12) - 1) = 3550 s, about half
    lost = 86400 - 7200 / (math.exp(7200 / 86400) - 1)
    assert lost == pytest.approx(3550.1, abs=0.1)
    assert per_node.synchronous.campaign_rework_gpu_hours == pytest.approx(30 * lost / 3600 * 64)


@pytest.mark.parametrize("interval_s, mtbf_s, lost_s", [
    (1.0, 1e9, 0.5),                # much shorter than the MTBF: half an interval
    (3600.0, 3600.0, 3600 - 3600 / (math.e - 1)),  # 1 - 1/(e - 1) = 0.418 of the MTBF
    (7200.0, 1.0, 1.0),             # far longer: the MTBF itself, never more (and no overflow)
    (7200.0, math.inf, 3600.0),     # no failures (the library's PlanInputs take inf): no 0/0
])
def test_a_failure_loses_the_expected_work_since_the_last_checkpoint(interval_s, mtbf_s, lost_s) -> None:
    assert sizing.lost_per_failure(interval_s, mtbf_s) == pytest.approx(lost_s)


def test_an_interval_past_the_job_mtbf_misses_and_never_redoes_more_than_the_campaign() -> None:
    """405B parameters, 16,384 GPUs, a node MTBF of 1000 h: the job's is 29 min, and the default
    interval 2 h. Rework was failures x half an interval: 24.2 M GPU-hours redone of 11.8 M in the
    whole campaign, and plan passed. Now each failure loses at most the MTBF, and the plan misses
    naming a shorter --interval."""
    r = invoke("--params", "405B", "--gpus", "16384", "--bandwidth", "100GB/s", "--mtbf", "1000h", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    campaign = 16384 * 30 * 24
    for col in ("synchronous", "fastckpt"):
        assert 0.9 * campaign < d[col]["campaign_rework_gpu_hours"] < campaign  # 93 % of it redone
        assert not d[col]["passed"]
        assert any("interval is not shorter than the job's MTBF (1,758 s)" in t and "93.1 % of the GPU-hours" in t
                   for t in d[col]["problems"]), d[col]["problems"]
    assert "interval: shorter than the job's MTBF, e.g. --interval 478s, the Young/Daly interval" \
        in d["synchronous"]["advice"]
    # fastckpt's Young/Daly (8.34 s) is shorter than its drain (64.8 s): the fix is the drain's time
    assert any("--interval 64.8s, what the background tiers need" in a for a in d["fastckpt"]["advice"])
    fixed = invoke("--params", "405B", "--gpus", "16384", "--bandwidth", "100GB/s", "--mtbf", "1000h",
                   "--interval", "64.8s", "--json")
    assert fixed.exit_code == 0, fixed.output
    # a drain of 58.909 s: the advice is rounded up, never to 58.9 s, which misses again
    d = json.loads(invoke("--params", "405B", "--gpus", "16384", "--bandwidth", "110GB/s", "--mtbf", "1000h",
                          "--json").stdout)
    (advice,) = [a for a in d["fastckpt"]["advice"] if "what the background tiers need" in a]
    flag = re.search(r"--interval (\S+)s,", advice).group(1)
    assert float(flag) > 58.909 and invoke("--params", "405B", "--gpus", "16384", "--bandwidth", "110GB/s",
                                           "--mtbf", "1000h", "--interval", f"{flag}s").exit_code == 0


def test_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="mtbf_per"):
        sizing.PlanInputs(state_bytes=1, bandwidth_Bps=1, mtbf_per="rack")
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        sizing.PlanInputs(state_bytes=1, bandwidth_Bps=0)


# ---------------------------------------------------------------- the command
def test_json_keys_and_exit_0() -> None:
    r = invoke("--params", "70B", "--preset", "mixed-adam", "--gpus", "1024", "--bandwidth", "10GB/s",
               "--mtbf", "5000h", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for key in ("state_bytes", "write_seconds", "required_write_Bps", "overhead_fraction", "campaign_stall_hours",
                "campaign_gpu_hours_lost", "young_daly_interval_seconds"):
        assert key in d
    assert d["state_bytes"] == pytest.approx(1.12e12)
    assert d["write_seconds"] == pytest.approx(112)
    assert d["job_mtbf_seconds"] == pytest.approx(5000 * 3600 / 128)
    assert d["young_daly_interval_seconds"] == pytest.approx(math.sqrt(2 * 112 * 5000 * 3600 / 128))
    assert d["fastckpt"]["passed"] and d["passed"]


def test_table_shows_both_strategies_and_the_verdict() -> None:
    r = invoke("--state-size", "1.4TB", "--bandwidth", "10GB/s", "--gpus", "64")
    assert r.exit_code == 0, r.output
    for text in ("1.4 TB", "140 s", "synchronous", "fastckpt", "PASS", "GB = 1e9"):
        assert text in r.stdout


def test_a_missed_budget_exits_1_with_the_fix() -> None:
    r = invoke("--state-size", "1.4TB", "--bandwidth", "0.1GB/s", "--interval", "1h", "--gpus", "8")
    assert r.exit_code == 1
    assert "MISS" in r.stdout and "falls short" in r.stdout


@pytest.mark.parametrize("args", [["--params", "70B", "--state-size", "1TB", "--bandwidth", "1GB/s"],
                                  ["--params", "70B"],  # no bandwidth
                                  ["--bandwidth", "1GB/s"],  # no state
                                  ["--params", "seventy", "--bandwidth", "1GB/s"],
                                  ["--params", "70B", "--preset", "mixed-adam", "--bytes-per-param", "3",
                                   "--bandwidth", "1GB/s"]])
def test_bad_usage_exits_2(args: list[str]) -> None:
    assert invoke(*args).exit_code == 2


@pytest.mark.parametrize("args, flag", [
    (["--gpus", "0", "--params", "7B"], "--gpus"),
    (["--gpus-per-node", "0", "--params", "7B"], "--gpus-per-node"),
    (["--bytes-per-param", "0", "--params", "7B"], "--bytes-per-param"),
    (["--state-size", "0", "--params", "7B"], "--state-size"),
    (["--state-size", "0"], "--state-size"),
    (["--params", "0"], "--params"),
    (["--params", "1e400"], "--params"),
    (["--params", "7B", "--days", "inf"], "--days"),
    (["--params", "7B", "--days", "nan"], "--days"),
    (["--params", "7B", "--gpu-hour-cost", "inf"], "--gpu-hour-cost"),
    (["--params", "7B", "--interval", "0"], "--interval"),
    (["--params", "7B", "--budget", "0s"], "--budget"),
    (["--params", "7B", "--mtbf", "0h"], "--mtbf")])
def test_a_zero_or_non_finite_flag_is_named_not_replaced_by_a_default(args: list[str], flag: str) -> None:
    r = invoke(*args, "--bandwidth", "10GB/s", "--json")
    assert r.exit_code == 2, r.output
    assert f"'{flag}'" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("opts", [["--params", "1e300", "--bytes-per-param", "1e300"],
                                  ["--params", "7B", "--bandwidth", "1e-300B/s"],
                                  ["--params", "70B", "--snapshot-bandwidth", "1e-297B/s"]])  # only nested ones
def test_inputs_that_overflow_the_arithmetic_are_refused_not_printed_as_infinity(opts: list[str]) -> None:
    r = invoke("--bandwidth", "10GB/s", *opts, "--json")
    assert r.exit_code == 2, r.output
    assert "non-finite" in r.output and "Infinity" not in r.output


def test_from_run_on_an_empty_log_is_refused_naming_it(tmp_path) -> None:
    """With the state and bandwidth given, an empty log (a wrong path, a rank that never saved)
    was taken for a run and the plan exited 0 as if it had measured something."""
    log = tmp_path / "events.jsonl"
    log.write_text("")
    for given in ([], ["--params", "7B"], ["--state-size", "1TB"]):
        r = invoke("--from-run", str(log), "--bandwidth", "10GB/s", *given)
        assert r.exit_code == 2, r.output
        assert f"the event log {log} is empty (no event)" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("text, want", [("70B", 70e9), ("70b", 70e9), ("7e9", 7e9), ("1.3T", 1.3e12), ("350M", 350e6),
                                        ("125K", 125e3), ("1000", 1000)])
def test_params_are_a_count_with_a_unit(text: str, want: float) -> None:
    r = invoke("--params", text, "--preset", "weights-bf16", "--bandwidth", "10GB/s", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["state_bytes"] == pytest.approx(want * 2)


@pytest.mark.parametrize("text, fix", [
    ("70", "'70' is 70 parameters: write the unit, e.g. 70B for 70 billion (K, M, B or G, T: thousand, million, "
           "billion, trillion), or the whole count (e.g. 7e9)"),
    ("405", "e.g. 405B for 405 billion"), ("1e2", "e.g. 100B for 100 billion"),
    ("70GB", "'70GB' is a size in bytes, and --params counts parameters (70B is 70 billion): give the checkpoint's "
             "size as --state-size 70GB instead"),
    ("1.4TB", "--state-size 1.4TB"), ("70 GB", "--state-size 70GB instead"),  # as typed, the shell splits "70 GB"
    ("70bn", "write e.g. 70B, 7e9, 1.5T, 350M (K, M, B or G, T: 1e3, 1e6, 1e9, 1e12)")])
def test_params_without_a_unit_or_in_bytes_are_refused_naming_the_fix(text: str, fix: str) -> None:
    """``--params 70`` (70B meant) was planned as a 1,120-byte state that passed, and ``--params
    70GB`` said only that it could not be read as a count."""
    r = invoke("--params", text, "--bandwidth", "10GB/s")
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--params': " in r.output and fix in " ".join(r.output.split()), r.output


def test_help_says_what_params_counts() -> None:
    text = " ".join(invoke("--help").stdout.split())
    assert "a count (not bytes): 70B is 70 billion, also 7e9, 1.3T, 350M" in text


def test_help() -> None:
    r = invoke("--help")
    assert r.exit_code == 0 and "--mtbf-per" in r.stdout and "mixed-adam 16 B" in r.stdout


# ---------------------------------------------------------------- --from-run
@pytest.fixture(scope="module")
def run_log(tmp_path_factory) -> str:
    """A real run: three checkpoints of a group of two files through a burst buffer."""
    d = tmp_path_factory.mktemp("run")
    log = str(d / "events.jsonl")
    with fastckpt.Checkpointer(local_dir=str(d / "bb"), event_log=log) as ck:
        for step in (1, 2, 3):
            group = str(d / "home" / f"step-{step}")
            for name in ("a.pt", "b.pt"):
                ck.save({"w": torch.full((1 << 18,), step, dtype=torch.float32)}, f"{group}/{name}", group=group)
            ck.commit(group, step=step).wait()
    return log


def test_from_run_on_a_log_without_saves_says_so(run_log: str, tmp_path) -> None:
    log = tmp_path / "events.jsonl"  # the run's replications only: no snapshot, so no save completed
    log.write_text("".join(line for line in open(run_log) if json.loads(line)["name"] == "replicate"))
    r = invoke("--from-run", str(log), "--bandwidth", "10GB/s")
    assert r.exit_code == 2, r.output
    assert "no completed save" in r.output and str(log) in r.output


@pytest.mark.parametrize("extra", [["--preset", "fp8-adam"], ["--bytes-per-param", "2"]], ids=["preset", "bpp"])
def test_a_per_parameter_size_without_params_is_refused_not_ignored(run_log: str, extra: list[str]) -> None:
    """--preset and --bytes-per-param size --params only. Before, with --state-size (or --from-run and no
    --params) they were dropped without a word: a plan for 1.4 TB for a user who meant 1.4T parameters x 11 B."""
    flag = extra[0]
    r = invoke("--state-size", "1.4TB", "--bandwidth", "10GB/s", *extra)
    assert r.exit_code == 2, r.output
    assert f"{flag} sizes --params" in r.output and f"leave {flag} out, or give --params" in r.output
    r = invoke("--from-run", run_log, "--bandwidth", "10GB/s", *extra)
    assert r.exit_code == 2, r.output
    assert f"{flag} sizes --params" in r.output and "one checkpoint of the run (--from-run)" in r.output
    r = invoke("--from-run", run_log, "--params", "70B", "--bandwidth", "10GB/s", *extra, "--json")
    assert r.exit_code in (0, 1), r.output  # with --params it sizes them, the run gives the rest (1: over budget)
    assert json.loads(r.stdout)["inputs"]["state_bytes"] == 70e9 * (11 if flag == "--preset" else 2)


def test_profile_of_a_real_event_log(run_log: str) -> None:
    events = read_events(run_log)
    prof = profile(events)
    commits = [e for e in events if e.name == "commit" and e.detail == "group"]
    assert prof.checkpoints == 3 and prof.ranks == 1
    assert prof.state_bytes == statistics.median(e.bytes for e in commits)  # both files of a group, as committed
    assert prof.write_tier == "nvme"
    assert prof.snapshot_Bps > 0 and prof.write_Bps > 0 and prof.replicate_Bps > 0


def test_from_run_fills_in_the_measured_values(run_log: str) -> None:
    prof = profile(read_events(run_log))
    r = invoke("--from-run", run_log, "--json")
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.stdout)
    assert d["state_bytes"] == prof.state_bytes
    assert d["gpus"] == 1
    assert d["inputs"]["bandwidth_Bps"] == pytest.approx(prof.replicate_Bps)
    assert d["inputs"]["snapshot_bandwidth_Bps"] == pytest.approx(prof.snapshot_Bps)
    assert d["inputs"]["local_bandwidth_Bps"] == pytest.approx(prof.write_Bps)
    assert d["measured"]["checkpoints"] == 3
    # the run's interval, noted (it was the 2 h default, silently: a run saving every 10 s passed)
    assert d["inputs"]["interval_s"] == pytest.approx(prof.interval_s)
    assert any(n.startswith("interval ") and "the run's median time between saves" in n for n in d["notes"])
    # flags win over measurements
    d2 = json.loads(invoke("--from-run", run_log, "--bandwidth", "5GB/s", "--interval", "30m", "--json").stdout)
    assert d2["inputs"]["bandwidth_Bps"] == 5e9 and d2["inputs"]["interval_s"] == 1800
    assert not any(n.startswith("interval ") for n in d2["notes"])
    assert json.loads(invoke("--params", "7B", "--bandwidth", "5GB/s", "--json").stdout)["inputs"]["interval_s"] == 7200


@pytest.mark.parametrize("burst_buffer", [False, True])
def test_a_lazy_saves_snapshot_is_timed_to_the_end_of_its_copy(tmp_path, burst_buffer: bool) -> None:
    """A lazy save's snapshot event spans the call only (the copy runs on until fence()): plan
    divided its bytes by that and measured hundreds of GB/s on a 2-core VM. Now the copy is timed
    from the call to its write's start, which waits for it: about what save() + fence() took."""
    log = str(tmp_path / "events.jsonl")
    w = torch.randn(1 << 23)  # 32 MiB: the copy takes far longer than the call
    blocked = []
    with fastckpt.Checkpointer(str(tmp_path / "bb") if burst_buffer else None, event_log=log,
                               overhead_budget=0.99) as ck:
        for step in range(5):
            t0 = time.perf_counter()
            h = ck.save({"w": w}, str(tmp_path / "home" / f"step-{step}.pt"), lazy=True)
            ck.fence()  # the optimizer step waits for the copy
            blocked.append(time.perf_counter() - t0)
            w.add_(1)
            h.wait()
    d = json.loads(invoke("--from-run", log, "--bandwidth", "1GB/s", "--json").stdout)
    copied_Bps = w.numel() * 4 / statistics.median(blocked)
    assert d["measured"]["snapshot_Bps"] < 3 * copied_Bps, (d["measured"]["snapshot_Bps"], copied_Bps)
    assert d["measured"]["lazy_snapshots"] == 5
    assert any("5 lazy save(s) timed from the call to the end of the copy" in n for n in d["notes"]), d["notes"]


def _commit_each(cks: list, groups: list[tuple[int, str]]) -> None:
    """Every rank saves its file of each (step, group) and commits it; then the ranks close."""
    try:
        for step, group in groups:
            for ck in cks:
                ck.save({"w": torch.full((1 << 18,), step, dtype=torch.float32)}, f"{group}/r{ck.rank}.pt",
                        group=group)
            for h in [ck.commit(group, step=step) for ck in cks]:
                h.wait(60)
    finally:
        close_all(cks)


@pytest.mark.parametrize("burst_buffer", [False, True])
def test_from_run_with_each_ranks_log_and_with_one_of_them(tmp_path, burst_buffer: bool) -> None:
    """Two ranks, each with its own event log, commit groups. Both logs: 2 GPUs, measured. One
    rank's log alone: before, plan took it for a 1-GPU run holding the whole state (so the
    bandwidth it derived was one process's); now it estimates the ranks from the share of each
    group that log's saves hold, and says how to give them all. Through a burst buffer too (its
    writes name the burst-buffer copies: once, no share was found and plan said 1 GPU)."""
    logs = [str(tmp_path / f"events-{r}.jsonl") for r in range(2)]
    cks = [fastckpt.Checkpointer(str(tmp_path / f"nvme{r}") if burst_buffer else None, rank=r, world_size=2,
                                 event_log=logs[r], overhead_budget=0.99) for r in range(2)]
    _commit_each(cks, [(step, str(tmp_path / "home" / f"step-{step}")) for step in (1, 2)])
    both = json.loads(invoke("--from-run", logs[0], "--from-run", logs[1], "--json").stdout)
    assert both["gpus"] == 2 and "GPUs: 2, the ranks in the run's event log" in both["notes"]
    assert both["measured"]["logged_share"] == pytest.approx(1.0, abs=0.05)
    one = json.loads(invoke("--from-run", logs[1], "--json").stdout)
    assert one["gpus"] == 2 and one["state_bytes"] == both["state_bytes"]
    assert one["measured"]["logged_share"] == pytest.approx(0.5, abs=0.03)
    assert any(re.match(r"GPUs: 2, estimated: the 1 rank\(s\) in the event log saved 50% of each checkpoint", n)
               for n in one["notes"]), one["notes"]


@pytest.mark.parametrize("state", [{"w": [torch.zeros(64) for _ in range(50)]}, {"step": 1}],
                         ids=["many small tensors", "no tensors"])
def test_a_whole_log_of_one_rank_is_one_gpu_whatever_its_tensors(tmp_path, state: dict) -> None:
    """The share of a group a log holds compared the snapshots' tensor bytes with the files'
    sizes: 50 small tensors read as 47 % (plan invented a second rank), a state without tensors
    as 0 % (a ZeroDivisionError traceback). Now files are compared with files."""
    log = str(tmp_path / "events.jsonl")
    with fastckpt.Checkpointer(event_log=log, overhead_budget=0.99) as ck:
        for step in (1, 2, 3):
            group = str(tmp_path / f"step-{step}")
            ck.save(state, f"{group}/model.pt", group=group)
            ck.commit(group, step=step).wait()
    r = invoke("--from-run", log, "--bandwidth", "1GB/s", "--json")
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.stdout)
    assert d["gpus"] == 1 and d["measured"]["logged_share"] == pytest.approx(1.0)


def test_a_torn_last_line_is_skipped_and_a_bad_last_line_is_named(tmp_path, run_log: str) -> None:
    lines = open(run_log).read().splitlines()
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines) + '\n{"name": "snap')
    assert len(read_events(str(torn))) == len(lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + lines[1] + "\nnot json\n")
    r = invoke("--from-run", str(bad))
    assert r.exit_code == 2 and "bad.jsonl:3: not JSON" in r.output


def _event(name: str, rank: int, path: str, start: float, nbytes: int = 1000, detail: str | None = None) -> str:
    return json.dumps({"name": name, "rank": rank, "path": path, "bytes": nbytes, "start": start, "end": start + 0.01,
                       "tier": "direct", "error": None, "detail": detail})


@pytest.mark.parametrize("line, problem", [("null", "a JSON NoneType, not an event object"),
                                           ('"a string"', "a JSON str, not an event object"),
                                           ('[1, 2]', "a JSON list, not an event object"),
                                           (_event("snapshot", 0, "/x/a.pt", 1.0).replace('"rank": 0', '"rank": [0]'),
                                            "a field has the wrong type"),
                                           ('{"name": "snapshot"}', "missing rank")])
def test_from_run_names_a_line_that_is_not_an_event_as_report_does(tmp_path, line: str, problem: str) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text(_event("snapshot", 0, "/x/a.pt", 1.0) + "\n" + line + "\n")
    r = invoke("--from-run", str(log), "--bandwidth", "1GB/s")
    assert r.exit_code == 2, r.output
    assert f"events.jsonl:2: {problem}" in r.output and "Traceback" not in r.output
    rep = CliRunner().invoke(cli, ["report", str(log)])
    assert rep.exit_code == 2 and f"events.jsonl:2: {problem}" in rep.output


def test_a_resumed_jobs_log_skips_the_torn_line_and_counts_it(tmp_path, caplog) -> None:
    """A job killed mid-line, then resumed with the same event_log: the new job ends the torn
    line, and plan --from-run and report skip it with a warning (as serve-metrics does)."""
    log = tmp_path / "events.jsonl"

    def job(step: int) -> None:
        with fastckpt.Checkpointer(event_log=str(log), overhead_budget=0.99) as ck:
            ck.save({"w": torch.randn(1000)}, str(tmp_path / "home" / f"step-{step}.pt")).wait()

    job(1)
    with open(log, "a") as f:
        f.write('{"bytes": 4000, "detail": null, "name": "snaps')  # killed mid-line
    with fastckpt.Checkpointer(event_log=str(log)):  # a job that saved nothing leaves the log as it was
        pass
    assert log.read_text().endswith('"name": "snaps')
    job(2)
    lines = log.read_text().splitlines()
    torn = lines.index('{"bytes": 4000, "detail": null, "name": "snaps') + 1  # a line of its own
    assert 1 < torn < len(lines)
    r = invoke("--from-run", str(log), "--bandwidth", "1GB/s", "--json")
    assert r.exit_code in (0, 1), r.output
    measured = json.loads(r.stdout)["measured"]
    assert (measured["checkpoints"], measured["skipped_lines"]) == (2, 1)
    assert f"skipped a line that is not an event: {log}:{torn}: not JSON" in caplog.text
    rep = CliRunner().invoke(cli, ["report", str(log), "--json"])
    assert rep.exit_code in (0, 1), rep.output
    assert json.loads(rep.stdout)["events"] == len(lines) - 1
    junk = tmp_path / "junk.jsonl"  # no event at all: not an event log, refused
    junk.write_text("hello\nworld\n")
    assert invoke("--from-run", str(junk), "--bandwidth", "1GB/s").exit_code == 2


def test_separate_single_file_saves_in_quick_succession_are_separate_checkpoints(tmp_path) -> None:
    log = str(tmp_path / "events.jsonl")
    with fastckpt.Checkpointer(event_log=log, overhead_budget=0.99) as ck:
        for step in range(5):  # 5 checkpoints of 1 MiB each, one file each, ms apart
            ck.save({"w": torch.randn(1 << 18), "step": step}, str(tmp_path / "home" / f"step-{step}.pt")).wait()
    r = invoke("--from-run", log, "--bandwidth", "1GB/s", "--json")
    d = json.loads(r.stdout)
    assert (d["measured"]["checkpoints"], d["state_bytes"]) == (5, 1 << 20)


def test_what_makes_one_checkpoint_without_group_commits() -> None:
    from fastckpt.eventlog import parse_event

    def ckpts(*lines: str) -> tuple[int, float]:
        prof = profile([parse_event(x) for x in lines])
        return prof.checkpoints, prof.state_bytes

    # DeepSpeed's tag directories: several files of one rank, and of several ranks, are one checkpoint
    tag = [_event("snapshot", r, f"/c/global_step{s}/{f}", s + k * 0.001)
           for s in (10, 20) for k, (r, f) in enumerate([(0, "mp_rank_00_model_states.pt"),
                                                          (0, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                                          (1, "zero_pp_rank_1_mp_rank_00_optim_states.pt")])]
    assert ckpts(*tag) == (2, 3000)
    # a directory the log commits as a group (the commit failed), whatever its name
    group = [_event("snapshot", 0, f"/c/latest/{f}", 1.0 + k * 0.001) for k, f in enumerate(("a.pt", "b.pt"))]
    assert ckpts(*group, _event("commit", 0, "/c/latest", 1.1, 2000, detail="group").replace(
        '"error": null', '"error": "OSError()"')) == (1, 2000)
    # one file per rank, saved again and again at the same path, ms apart
    per_rank = [_event("snapshot", r, f"/c/rank{r}.pt", s + r * 0.001) for s in (1.0, 1.05, 1.1) for r in (0, 1)]
    assert ckpts(*per_rank) == (3, 2000)
    # a rank's separate files in one directory: one checkpoint each
    assert ckpts(*[_event("snapshot", 0, f"/c/home/model-{k}.pt", 1.0 + k * 0.03) for k in range(4)]) == (4, 1000)


@pytest.mark.parametrize("folder", ["step-", "global_step", "iter_000", "checkpoint-", "ckpt-", "ckpt_"])
def test_the_files_of_a_step_directory_are_one_checkpoint_however_far_apart(folder: str) -> None:
    """A rank saves model.pt, waits seconds for it (a large file), then optimizer.pt into the same
    step directory: plan took each file for a checkpoint once they were more than CLUSTER_GAP_S
    apart (a state of one file's size, an interval of the gap between them), and did not know
    Hugging Face's checkpoint-500 (nor ckpt-500, ckpt_500) for a step directory at all."""
    from fastckpt.cli.runlog import CLUSTER_GAP_S
    from fastckpt.eventlog import parse_event

    gap = CLUSTER_GAP_S + 0.2
    lines = [_event("snapshot", r, f"/c/{folder}{step}/{name}-{r}.pt", step + r * 2.5 + k * gap, nbytes)
             for step in (100, 200, 300) for r in (0, 1) for k, (name, nbytes) in enumerate([("model", 4000),
                                                                                            ("optimizer", 8000)])]
    prof = profile([parse_event(x) for x in lines])
    assert (prof.checkpoints, prof.state_bytes, prof.interval_s) == (3, 24000, 100)
    # the same file again in the same directory is the next checkpoint (a tag re-saved), at any gap
    again = [_event("snapshot", 0, f"/c/{folder}100/model.pt", t) for t in (1.0, 1.05, 9.0)]
    assert profile([parse_event(x) for x in again]).checkpoints == 3


def test_megatrons_rank_folders_belong_to_their_iteration_and_step_named_files_stand_alone() -> None:
    from fastckpt.eventlog import parse_event

    def ckpts(*paths_at: tuple[str, float]) -> tuple[int, float]:
        prof = profile([parse_event(_event("snapshot", 0, p, t)) for p, t in paths_at])
        return prof.checkpoints, prof.state_bytes

    # iter_0000100/mp_rank_00/: the model file, then the distributed optimizer's seconds later
    assert ckpts(*[(f"/c/iter_{it:07d}/mp_rank_00/{f}", it + k * 3.0) for it in (100, 200)
                   for k, f in enumerate(("model_optim_rng.pt", "distrib_optim.pt"))]) == (2, 2000)
    # a run folder whose name ends in a number holds one checkpoint per step-named file
    assert ckpts(*[(f"/c/ckpt1/step-{k}.pt", 1.0 + k * 0.03) for k in range(4)]) == (4, 1000)


@pytest.mark.parametrize("names", [("model_step{s}", "optimizer_step{s}"), ("checkpoint_{s}", "optimizer_{s}")])
def test_files_named_for_their_step_directorys_step_belong_to_it(names: tuple[str, str]) -> None:
    """step_100/model_step100.pt and step_100/optimizer_step100.pt, saved together, were each a
    checkpoint of their own (a step-named file stood alone wherever it was): twice the
    checkpoints, half the state, half the interval."""
    from fastckpt.eventlog import parse_event

    lines = [_event("snapshot", 0, f"/c/step_{s}/{n.format(s=s)}.pt", s + k * 0.3, nbytes)
             for s in (100, 200, 300) for k, (n, nbytes) in enumerate(zip(names, (4000, 8000)))]
    prof = profile([parse_event(x) for x in lines])
    assert (prof.checkpoints, prof.state_bytes, prof.interval_s) == (3, 12000, 100)


def test_separate_saves_in_one_epoch_or_top_k_folder_are_not_merged() -> None:
    """A file joined its step directory's newest checkpoint however far apart, so a per-epoch
    folder's saves (epoch_1/model_500.pt, model_1000.pt, ... 100 s apart) became one checkpoint,
    and a top-k folder's best.pt joined the last.pt saved before it."""
    from fastckpt.eventlog import parse_event

    def ckpts(*paths_at: tuple[str, float, int]) -> list[tuple[float, float]]:
        from fastckpt.cli.runlog import _checkpoints

        return _checkpoints([parse_event(_event("snapshot", 0, p, t, n)) for p, t, n in paths_at])

    epochs = [(f"/c/epoch_{ep}/model_{it}.pt", (ep - 1) * 400 + it / 5, 5000) for ep in (1, 2)
              for it in (500, 1000, 1500, 2000)]
    assert ckpts(*epochs) == [(t, 5000) for _, t, _ in epochs]
    # last.pt every 100 s; best.pt when validation improves, 30 s after a save
    top_k = sorted([("/c/ckpt3/last.pt", t, 1000) for t in (100, 200, 300, 400)] +
                   [("/c/ckpt3/best.pt", t, 3000) for t in (130, 330)], key=lambda x: x[1])
    assert ckpts(*top_k) == [(t, n) for _, t, n in top_k]


def test_numbered_shards_of_one_save_folder_and_an_often_resaved_file_elsewhere_keep_it_whole() -> None:
    """The number rule split one rank's step_100/model_shard_0..3.pt (3 s apart on slow storage)
    into four checkpoints, and one run-wide join limit, set by a small ema_last.pt re-saved every
    30 s, cut each DeepSpeed tag's rank files (4 s apart) apart: a folder named for one save
    keeps its numbered files, and the limit is each folder's own."""
    from fastckpt.cli.runlog import _checkpoints
    from fastckpt.eventlog import parse_event

    def ckpts(*paths_at: tuple[int, str, float]) -> list[tuple[float, float]]:
        ordered = sorted(paths_at, key=lambda x: x[2])
        return _checkpoints([parse_event(_event("snapshot", r, p, t)) for r, p, t in ordered])

    shards = [(0, f"/c/step_{s}/model_shard_{i}.pt", s * 3 + i * 3) for s in (100, 200, 300) for i in range(4)]
    assert ckpts(*shards) == [(s * 3.0, 4000) for s in (100, 200, 300)]
    tags = [(r, f"/c/global_step{s}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt", s * 3 + r * 4)
            for s in (100, 200, 300) for r in range(4)]
    ema = [(0, "/c/ema/ema_last.pt", 7.0 + 30 * k) for k in range(30)]
    tag_ckpts = [c for c in ckpts(*tags, *ema) if c[1] == 4000]
    assert tag_ckpts == [(s * 3.0, 4000) for s in (100, 200, 300)]


def test_saves_into_a_run_folder_named_like_a_step_stay_separate() -> None:
    """A run folder named ckpt1 matches a step's name: 5fdc797 turned the number rule off there,
    so model_500.pt + optim_500.pt, then model_1000.pt + optim_1000.pt 600 s later, ... were one
    checkpoint of the whole run's bytes, with no interval. Numbers above a save folder's step
    (and above ``SHARD_NUMBERS``) are steps, not shards."""
    from fastckpt.cli.runlog import _checkpoints
    from fastckpt.eventlog import parse_event

    saves = [(f"/r/ckpt1/{name}_{it}.pt", it * 1.2 + k * 2) for it in (500, 1000, 1500)
             for k, name in enumerate(("model", "optim"))]
    assert _checkpoints([parse_event(_event("snapshot", 0, p, t)) for p, t in saves]) == [
        (it * 1.2, 2000) for it in (500, 1000, 1500)]


def test_from_run_on_a_hugging_face_style_run(tmp_path) -> None:
    """A real run saving checkpoint-N/model.pt and checkpoint-N/optimizer.pt back to back."""
    log = str(tmp_path / "events.jsonl")
    with fastckpt.Checkpointer(event_log=log, overhead_budget=0.99) as ck:
        for step in (100, 200, 300):
            for name, n in (("model", 1 << 18), ("optimizer", 1 << 19)):
                ck.save({"w": torch.zeros(n)}, str(tmp_path / "home" / f"checkpoint-{step}" / f"{name}.pt")).wait()
    d = json.loads(invoke("--from-run", log, "--bandwidth", "1GB/s", "--json").stdout)
    assert (d["measured"]["checkpoints"], d["state_bytes"]) == (3, 3 << 20)


# ---------------------------------------------------------------- host memory for the staging buffers
def test_staging_buffers_that_do_not_fit_the_host_memory_miss() -> None:
    # 70B, mixed Adam: 1.12 TB over 8 nodes is 140 GB of pinned staging per node
    small = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=20 * GB, gpus=64,
                                          host_memory_bytes=256 * GB))
    assert not small.fastckpt.passed
    assert "pin 140 GB per node, more than 50% of its 256 GB" in small.fastckpt.problems[0]
    # 17.5 GB per GPU, 128 GB per node: 7 GPUs' shares fit, so 10 nodes (9 would put 8 on one: 140 GB)
    assert "10 nodes or more (at most 7 GPUs per node)" in small.fastckpt.advice[0]
    assert "tier='gds'" in small.fastckpt.advice[0]
    for gpus_per_node in (7, 8):  # the advice, followed, passes (it said 9 nodes, which still missed)
        spread = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=20 * GB, gpus=64,
                                               gpus_per_node=gpus_per_node, host_memory_bytes=256 * GB))
        assert spread.fastckpt.passed == (gpus_per_node == 7)
    one = sizing.plan(sizing.PlanInputs(state_bytes=1.6 * TB, bandwidth_Bps=20 * GB, gpus=4,
                                        host_memory_bytes=512 * GB))  # 400 GB per GPU, 256 GB per node
    assert "no number of nodes does" in one.fastckpt.advice[-1] and "nodes or more" not in one.fastckpt.advice[-1]
    big = sizing.plan(sizing.PlanInputs(state_bytes=1.12 * TB, bandwidth_Bps=20 * GB, gpus=64,
                                        host_memory_bytes=2 * TB))
    assert big.fastckpt.passed and big.fastckpt.problems == ()
    assert not any("host memory" in n for n in big.notes)


def test_plan_says_what_the_staging_buffers_pin_and_checks_host_memory() -> None:
    r = invoke("--params", "70B", "--gpus", "64", "--bandwidth", "20GB/s", "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["staging_bytes_per_node"] == pytest.approx(140 * GB)
    assert any("pins 140 GB of host memory per node" in n and "--host-memory" in n for n in d["notes"])
    r = invoke("--params", "70B", "--gpus", "64", "--bandwidth", "20GB/s", "--host-memory", "256GB")
    assert r.exit_code == 1 and "the staging buffers pin 140 GB per node" in r.stdout
    r = invoke("--params", "1.3T", "--gpus", "8", "--bandwidth", "20GB/s")  # one node's 20.8 TB: no 2.08e+04 GB
    assert r.exit_code == 0 and "pins 20.8 TB of host memory per node" in r.stdout, r.stdout


def test_a_group_re_saved_under_one_path_is_one_checkpoint_per_commit(tmp_path) -> None:
    """Two ranks re-save one `last` group three times. plan took the group's path for one
    checkpoint: no interval (the 2 h default, "fewer than two saves") and each re-save's files
    summed against one commit's total (a share of 1.5 for one of the two ranks' logs, 1 GPU).
    Now each commit is a checkpoint, as report counts them, compared with its own files."""
    logs = [str(tmp_path / f"events-{r}.jsonl") for r in range(2)]
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, event_log=logs[r], overhead_budget=0.99) for r in range(2)]
    _commit_each(cks, [(step, str(tmp_path / "home" / "last")) for step in range(3)])
    report = json.loads(CliRunner().invoke(cli, ["report", *logs, "--json"]).stdout)
    both = json.loads(invoke("--from-run", logs[0], "--from-run", logs[1], "--json").stdout)
    assert both["measured"]["checkpoints"] == report["group_commits"] == 3
    assert both["measured"]["interval_s"] is not None and not any("the default" in n for n in both["notes"])
    assert both["gpus"] == 2 and both["measured"]["logged_share"] == pytest.approx(1.0, abs=0.05)
    one = json.loads(invoke("--from-run", logs[1], "--json").stdout)
    assert one["measured"]["checkpoints"] == 3 and one["measured"]["interval_s"] is not None
    assert one["gpus"] == 2 and one["measured"]["logged_share"] == pytest.approx(0.5, abs=0.03)


def test_large_counts_rates_and_percentages_print_without_e_notation() -> None:
    """``--params 1.3T --interval 60s`` printed ``4.32e+04`` checkpoints, ``3.47e+03 %`` and
    ``1.733e+04 GB/s (1.73e+03x)``."""
    r = invoke("--params", "1.3T", "--bandwidth", "10GB/s", "--interval", "60s")
    assert r.exit_code == 1 and "e+" not in r.stdout, r.stdout
    text = " ".join(r.stdout.split())
    assert "43,200" in text and "3,467 % of the interval" in text and "17,333 GB/s at this interval (1,733x)" in text
