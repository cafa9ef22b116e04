"""The recursa-vs-TRL benchmark runs end to end on the tiny model (benchmarks/vs_trl.py --smoke)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "vs_trl.py"


def _vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_run_table(data: dict, md: str, entries: list[str], pairs: list[str], repeats: int, whole_steps: int) -> None:
    """One run's table: its entries alternated repeat by repeat (step runs, then whole runs, per
    setting), the host's matmul rate probed at both ends and printed in the header, each ratio
    recomputed by hand from the runs' own times (per repeat, median, range), and the whole-run
    column filled from the whole runs."""
    import statistics

    meta, machine, res = data["meta"], data["machine"], data["short"]
    assert meta["repeats"] == repeats and meta["whole_run_steps"] == whole_steps and meta["frameworks"] == entries
    sched = meta["schedule"]
    assert len(sched) == 2 * repeats * len(entries)
    for rep in range(repeats):
        order = entries if rep % 2 == 0 else entries[::-1]
        mine = [e for e in sched if e["repeat"] == rep]
        assert [e["framework"] for e in mine] == order + order and [e["run"] for e in mine] == ["steps"] * len(order) + ["whole"] * len(order)
    assert [e["repeat"] for e in sched] == sorted(e["repeat"] for e in sched)  # a repeat ends before the next begins
    mm0, mm1 = machine["matmul_start"]["best_gflops"], machine["matmul_end"]["best_gflops"]
    assert mm0 > 0 and mm1 > 0 and machine["matmul_gflops"] == max(mm0, mm1)
    assert f"{mm0:.1f} GFLOP/s at the start, {mm1:.1f} at the end" in md
    orders = "; ".join(f"repeat {r + 1}: {', '.join(entries if r % 2 == 0 else entries[::-1])}" for r in range(repeats))
    assert orders in md
    header = next(line for line in md.splitlines() if line.startswith("| setting | framework |"))
    assert header.endswith(f"| whole run s ({whole_steps} steps) |")
    for fw in entries:
        walls = res[fw]["whole_run_s_all"]
        assert walls == [e["wall_s"] for e in sched if e["framework"] == fw and e["run"] == "whole"] and len(walls) == repeats and min(walls) > 0
        assert res[fw]["whole_run_s"] == statistics.median(walls)
        assert len(res[fw]["s_per_step_all"]) == repeats
    assert sorted(res["ratios"]) == sorted(pairs)
    for pair in pairs:
        fw, base = pair.split(" vs ")
        for key, ent, bas in (
            ("s_per_step", [statistics.median(r[1:]) for r in res[fw]["s_per_step_all"]], [statistics.median(r[1:]) for r in res[base]["s_per_step_all"]]),
            ("whole_run", res[fw]["whole_run_s_all"], res[base]["whole_run_s_all"]),
        ):
            sp = res["ratios"][pair][key]
            by = [b / e for b, e in zip(bas, ent)]
            assert sp["by_repeat"] == pytest.approx(by) and sp["n"] == repeats
            assert sp["median"] == pytest.approx(statistics.median(by)) and (sp["min"], sp["max"]) == pytest.approx((min(by), max(by)))
        row = next(line for line in md.splitlines() if line.startswith(f"| short | {pair} |"))
        st, wr = res["ratios"][pair]["s_per_step"], res["ratios"][pair]["whole_run"]
        assert f"**{st['median']:.2f}x** [{st['min']:.2f}-{st['max']:.2f}]" in row and f"**{wr['median']:.2f}x** [{wr['min']:.2f}-{wr['max']:.2f}]" in row


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e .[bench])")
def test_vs_trl_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--recursa-decode", "bfloat16", "--repeats", "2", "--whole-run-steps", "2", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "vs_trl.json").read_text())
    assert set(data) >= {"short", "machine"}
    assert data["machine"]["matmul_gflops"] > 0
    assert data["machine"]["threads"] == 2
    res = data["short"]
    assert set(res) >= {"settings", "recursa", "trl", "speedup"}
    assert res["speedup"] > 0
    steps = data["meta"]["steps"]
    for fw in ("recursa", "trl"):
        r = res[fw]
        assert r["warmup_s_per_step"] > 0
        assert r["median_s_per_step"] > 0
        assert all(len(run) == steps and all(t > 0 for t in run) for run in r["s_per_step_all"])
        assert len(r["reward_curve"]) == steps
        assert r["peak_rss_mb"] > 0
        assert r["gen_tokens_per_s"] > 0 and r["trained_tokens_per_s"] > 0
        assert r["threads"] == [2]
    # both frameworks saw exactly the same prompts (same chat template and system prompt)
    assert res["recursa"]["mean_prompt_tokens"] == res["trl"]["mean_prompt_tokens"] > 0
    assert (tmp_path / "vs_trl.md").read_text().startswith("# recursa vs TRL")
    assert (tmp_path / "vs_trl.png").stat().st_size > 0
    # the bfloat16-decode entry is compared with TRL and with float32 recursa
    assert res["speedup_variants"]["recursa-bfloat16"] > 0 and res["speedup_vs_recursa"]["recursa-bfloat16"] > 0
    assert "recursa-bfloat16: speedup" in (tmp_path / "vs_trl.md").read_text()
    # TRL alternated with both recursa entries, the ratios of each over TRL (and of the copy over float32) with their spread
    _check_run_table(data, (tmp_path / "vs_trl.md").read_text(), ["recursa", "recursa-bfloat16", "trl"],
                     ["recursa vs trl", "recursa-bfloat16 vs trl", "recursa-bfloat16 vs recursa"], repeats=2, whole_steps=2)


def test_vs_trl_decode_variant_is_its_own_entry(tmp_path):
    """--recursa-decode bfloat16 runs recursa a second time with a bfloat16 sampling copy
    (rollout.decode_dtype) and reports it beside float32 recursa: its own timings, and the
    sampler's log-prob gap to the float32 trainer, which is 0 (to rounding) for float32 and
    larger for the copy. Runs without TRL (--recursa-only)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--recursa-only", "--recursa-decode", "bfloat16", "--repeats", "2", "--whole-run-steps", "2",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "vs_trl.json").read_text())
    res = data["short"]
    # two repeats, alternated; whole `recursa train` runs of 2 steps; the copy's ratio over float32 with its spread
    _check_run_table(data, (tmp_path / "vs_trl.md").read_text(), ["recursa", "recursa-bfloat16"], ["recursa-bfloat16 vs recursa"], repeats=2, whole_steps=2)
    fp32, bf16 = res["recursa"], res["recursa-bfloat16"]
    assert bf16["median_s_per_step"] > 0 and len(bf16["reward_curve"]) == len(fp32["reward_curve"])
    assert bf16["mean_prompt_tokens"] == fp32["mean_prompt_tokens"]  # the same prompts
    assert fp32["logprob_mismatch"] < 1e-5 < bf16["logprob_mismatch"]
    assert res["trl"] is None and res["speedup_variants"] == {"recursa-bfloat16": None}
    assert res["speedup_vs_recursa"]["recursa-bfloat16"] > 0
    assert "| short | recursa-bfloat16 |" in (tmp_path / "vs_trl.md").read_text()


def test_vs_trl_whole_run_is_the_step_benchmarks_config():
    """The whole run `recursa train` plays is the step benchmark's config (the agent setting's env
    named as a factory, no held-out evaluation), and its prompts are TRL's dataset, step by step."""
    import tomllib

    from recursa.config import load_config
    from recursa.recipes.grpo import train_seeds

    vt = _vs_trl()
    for name in ("short", "agent"):
        spec = dict(vt.SETTINGS[name], decode_dtype="bfloat16")
        cfg = vt.recursa_config(spec, "tiny-random", 3)
        toml = vt.whole_run_toml(spec, "tiny-random", 3)
        whole = load_config(None, [f"{k}={v}" for k, v in _flatten(tomllib.loads(toml)).items()], check=False)  # the factory imports with benchmarks/ on PYTHONPATH
        a, b = cfg.model_dump(), whole.model_dump()
        assert b["eval"]["before"] is False and b["eval"]["after"] is False
        assert b["env"]["name"] == ("arithmetic" if name == "short" else vt.AGENT_ENV_FACTORY)
        for d in (a, b):
            d["env"].pop("name")
            d.pop("eval")
        assert a == b and b["rollout"]["decode_dtype"] == "bfloat16" and b["train"]["steps"] == 3
        rows = vt.trl_rows(spec, 3)
        assert [r["seed"] for r in rows] == [s for k in range(3) for s in train_seeds(whole, k)]


def _flatten(d: dict, prefix: str = "") -> dict:
    import json as _json

    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(_flatten(v, f"{prefix}{k}."))
        elif k == "kwargs":
            out[f"{prefix}{k}"] = "{" + ", ".join(f"{kk} = {_json.dumps(vv)}" for kk, vv in v.items()) + "}"
        else:
            out[f"{prefix}{k}"] = _json.dumps(v)
    return out


def test_vs_trl_ratios_and_header_by_hand():
    """vs_trl's ratio spread and table on hand-made numbers: per repeat, median and range; a
    missing run leaves its repeat out; a matmul rate that moved by more than 10% is flagged."""
    vt = _vs_trl()
    assert vt.ratio_by_repeat([6.0, 9.0, 4.0], [2.0, 3.0, None]) == [3.0, 3.0, None]
    sp = vt.spread([3.0, 2.0, None, 5.0])
    assert (sp["median"], sp["min"], sp["max"], sp["n"]) == (3.0, 2.0, 5.0, 3) and vt.spread([None]) is None
    sched = [{"repeat": r, "setting": "short", "framework": fw, "run": run} for r, order in enumerate((["recursa", "trl"], ["trl", "recursa"]))
             for run in ("steps", "whole") for fw in order]
    assert vt.run_orders(sched) == [["recursa", "trl"], ["trl", "recursa"]]
    row = {"mean_prompt_tokens": 35.0, "warmup_s_per_step": 2.0, "median_s_per_step": 1.0, "median_rollout_s": 0.5, "median_update_s": 0.5,
           "gen_tokens_per_s": 10.0, "trained_tokens_per_s": 100.0, "peak_rss_mb": 400.0, "mfu_gen": 0.1, "mfu_update": 0.2, "reward_curve": [0.5]}
    ratios = {"recursa vs trl": {"s_per_step": vt.spread([3.0, 2.0]), "whole_run": vt.spread([1.5, 1.25])}}
    results = {"model": "m", "steps": 3, "repeats": 2, "whole_run_steps": 4, "schedule": sched, "started_utc": "t0", "ended_utc": "t1",
               "machine": {"torch": "x", "transformers": "y", "trl": "z", "threads": 2, "matmul_start": {"best_gflops": 100.0, "n": 2048, "reps": 5},
                           "matmul_end": {"best_gflops": 80.0, "n": 2048, "reps": 5}, "matmul_drift": -0.2},
               "settings": {"short": {"recursa": {**row, "whole_run_s": 10.0}, "trl": {**row, "whole_run_s": 14.0}, "ratios": ratios}}}
    md = vt.markdown(results)
    assert "100.0 GFLOP/s at the start, 80.0 at the end** (-20%)" in md and "read the timings with care" in md
    assert "repeat 1: recursa, trl; repeat 2: trl, recursa" in md
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| short | ") and " vs " not in line}
    assert rows["recursa"].endswith("| 0.500 | 10.0 |") and rows["trl"].endswith("| 0.500 | 14.0 |") and "| whole run s (4 steps) |" in md
    assert "| short | recursa vs trl | 3.00, 2.00 | **2.50x** [2.00-3.00] | 1.50, 1.25 | **1.38x** [1.25-1.50] |" in md
    results["machine"]["matmul_end"]["best_gflops"], results["machine"]["matmul_drift"] = 95.0, -0.05
    assert "read the timings with care" not in vt.markdown(results)


def test_vs_trl_without_trl_exits_2(tmp_path):
    """Without TRL the script says so in one line and exits 2 (unless --recursa-only)."""
    code = (
        "import runpy, sys; sys.modules['trl'] = None; "
        f"sys.argv = [{str(SCRIPT)!r}, '--smoke', '--out', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "TRL is not installed" in proc.stderr
    assert not (tmp_path / "vs_trl.json").exists()


def test_exploration_probe_scores_replies_with_the_tempered_softmax():
    """benchmarks/exploration_probe.py's scorer: at every temperature, the probabilities of all
    one-token replies sum to 1 (the sampler's tempered softmax, read at the right position),
    two-token replies chain the conditionals, and T = 1 matches a plain forward pass."""
    import math

    import torch

    from recursa.config import ModelConfig
    from recursa.models import build_tiny_model, tiny_tokenizer

    spec = importlib.util.spec_from_file_location("exploration_probe", REPO / "benchmarks" / "exploration_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = build_tiny_model(ModelConfig(name="tiny-random"), tok).eval()
    prompt = tok("go to the fridge", add_special_tokens=False)["input_ids"]
    vocab = len(tok)
    for t in (1.0, 1.5, 2.0):
        total = sum(math.exp(v) for v in probe.sequence_logprobs(model, prompt, [[i] for i in range(vocab)], [t])[t])
        assert abs(total - 1.0) < 1e-4, (t, total)
    a, b = 7, 11
    two = probe.sequence_logprobs(model, prompt, [[a, b]], [1.0])[1.0][0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [a, b]])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    expected = lp[len(prompt) - 1, a] + lp[len(prompt), b]
    assert abs(two - expected.item()) < 1e-4


def test_methods_demo_runs_compares_and_reuses(tmp_path):
    """benchmarks/methods_demo.py --tiny: each method's run writes its result file, the table pairs it
    with grpo on the same items, and a second invocation reuses the files instead of training again;
    a method with a start of its own trains that start first."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "benchmarks/methods_demo.py", "--tiny", "--out", str(tmp_path / "res"), "--runs-dir", str(tmp_path / "runs"),
           "--methods", "grpo,spo,self_reward"]
    first = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    for name in ("grpo", "spo", "arithmetic_sft", "self_reward"):
        r = json.loads((tmp_path / "res" / f"{name}.json").read_text())
        assert r["settings"]["method"] == name and len(r["after"]["items"]) == 8
    spo = json.loads((tmp_path / "res" / "spo.json").read_text())
    assert 'algo.objective="spo"' in spo["settings"]["sets"] and len(spo["train_reward"]) == 2
    assert json.loads((tmp_path / "res" / "self_reward.json").read_text())["settings"]["start"] == "arithmetic_sft"
    table = (tmp_path / "res.md").read_text()
    assert "| spo |" in table and "| self_reward |" in table and "p = " in table
    second = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.count("committed result") == 3 and "running" not in second.stdout
    # a method with a baseline of its own (another task) is compared with it, not with grpo
    third = subprocess.run([*cmd[:-1], "arith_grpo,arith_tail"], cwd=repo, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in (tmp_path / "res.md").read_text().splitlines() if line.startswith("| arith_")}
    assert "vs arith_grpo: +" in rows["arith_tail"] and "(the baseline of arith_progress, arith_schedule, arith_tail)" in rows["arith_grpo"]
    assert "curriculum.tail.enabled=false" not in json.loads((tmp_path / "res" / "arith_tail.json").read_text())["settings"]["sets"]



def test_methods_demo_pairs_a_method_with_each_of_its_baselines(tmp_path):
    """A method with two baselines (B-STaR: expert iteration at equal rounds and at equal episodes)
    gets one paired comparison with each, counted by hand; each baseline names its user."""
    import json

    spec = importlib.util.spec_from_file_location("methods_demo", REPO / "benchmarks" / "methods_demo.py")
    md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md)
    assert md.baselines_of("arith_bstar") == ("arith_rft", "arith_rft_equal") and md.baselines_of("spo") == ("grpo",)
    wins = {"arith_bstar": [1, 1, 1, 0, 0, 1], "arith_rft": [0, 0, 1, 0, 0, 1], "arith_rft_equal": [1, 0, 0, 1, 0, 1]}
    for name, ok in wins.items():
        items = [[seed, bool(o)] for seed, o in enumerate(ok)]
        after = {"success": sum(ok) / len(ok), "ci95": [0.0, 1.0], "items": items}
        (tmp_path / f"{name}.json").write_text(json.dumps({"after": after, "switch": name}))
    rows = {line.split("|")[1].strip(): line for line in md.report(tmp_path).splitlines() if line.startswith("| arith_")}
    # bstar against rft: won items 0 and 1, lost none; against rft_equal: won 1 and 2, lost 3
    assert "vs arith_rft: +2/-0, +0.333" in rows["arith_bstar"] and "vs arith_rft_equal: +2/-1, +0.167" in rows["arith_bstar"]
    assert "(the baseline of arith_bstar)" in rows["arith_rft"] and "(the baseline of arith_bstar)" in rows["arith_rft_equal"]

def _failure_modes():
    spec = importlib.util.spec_from_file_location("failure_modes", REPO / "benchmarks" / "failure_modes.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    return fm


def test_failure_modes_classifies_household_transcripts_by_hand():
    """benchmarks/failure_modes.py: each lost game gets the first mode that fits (hand-made transcripts)."""
    fm = _failure_modes()
    go = ["go to fridge 1", "open fridge 1"]
    assert fm.classify(go + ["take mug 1 from fridge 1", "go to cabinet 1", "put mug 1 in cabinet 1"], True, "mug", "cabinet", None) == ("won", False)
    assert fm.classify(go + ["go to cabinet 1"] * 3, False, "mug", "cabinet", None) == ("never_took", True)
    assert fm.classify(go + ["take egg 1 from fridge 1", "go to cabinet 1"], False, "mug", "cabinet", None) == ("wrong_object", False)
    assert fm.classify(go + ["take mug 1 from fridge 1", "go to cabinet 1"], False, "mug", "cabinet", "cool") == ("no_verb", False)
    assert fm.classify(go + ["take mug 1 from fridge 1", "go to microwave 1", "heat mug 1 with microwave 1"], False, "mug", "cabinet", "cool") == ("other_verb", False)
    assert fm.classify(go + ["take mug 1 from fridge 1", "go to fridge 1", "cool mug 1 with fridge 1", "go to cabinet 1"], False, "mug", "cabinet", "cool") == ("not_placed", False)


def test_failure_modes_reads_an_eval_json_and_a_benchmark_result_file_alike(tmp_path):
    """benchmarks/failure_modes.py: a benchmark result file (heldout.items) is analysed exactly
    as the run's own eval JSON (items) holding the same games."""
    fm = _failure_modes()
    items = [{"seed": 2_000_000_000 + i, "success": False, "completion": "go to cabinet 1 | go to cabinet 1 | go to cabinet 1"} for i in range(3)]
    (tmp_path / "eval.json").write_text(json.dumps({"items": items}))
    (tmp_path / "result.json").write_text(json.dumps({"spec": {}, "heldout": {"items": items}}))
    a = fm.analyse(tmp_path / "eval.json", fm.HOUSEHOLD_KWARGS)
    b = fm.analyse(tmp_path / "result.json", fm.HOUSEHOLD_KWARGS)
    assert a["n"] == b["n"] == 3 and a["by_task_type"] == b["by_task_type"]
    assert sum(c["never_took"] for c in a["by_task_type"].values()) == 3


def test_decode_precision_gap_is_zero_for_the_same_model_and_grows_with_noise(tmp_path):
    """benchmarks/decode_precision.py's measure: a model against itself gives KL 0 and no log-prob
    gap; perturbing its weights gives a positive KL and gap; the script writes its table."""
    import torch

    from recursa.config import ModelConfig
    from recursa.models import load_policy

    spec = importlib.util.spec_from_file_location("decode_precision", REPO / "benchmarks" / "decode_precision.py")
    dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp)
    policy = load_policy(ModelConfig(name="tiny-random"))
    model = policy.causal_lm.eval()
    batch = dict(policy.tokenizer(dp.TEXTS[:2], return_tensors="pt", padding=True))
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch).logits.float(), dim=-1)
    same = dp.gap(ref, model, batch)
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-6) and same["abs_dlogp_mean"] == pytest.approx(0.0, abs=1e-6)
    noisy = __import__("copy").deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    moved = dp.gap(ref, noisy, batch)
    assert moved["kl_mean"] > 1e-3 and moved["abs_dlogp_mean"] > 1e-3 and moved["kl_max"] >= moved["kl_mean"]
    assert dp.main(["--model", "tiny-random", "--out", str(tmp_path), "--threads", "1"]) == 0
    rows = json.loads((tmp_path / "decode_precision.json").read_text())["rows"]
    assert {"decode_dtype = bfloat16", "decode_dtype = int8", "int8 on down_proj only"} <= set(rows)
    assert "| decode_dtype = int8 |" in (tmp_path / "decode_precision.md").read_text()


def _bench(args: list[str], timeout: int = 300):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    return done.stdout


def test_profile_step_runs_on_the_tiny_model():
    """benchmarks/profile_step.py imports what the recipes export today and profiles one step."""
    out = _bench(["benchmarks/profile_step.py", "--model", "tiny-random", "--setting", "short", "--top", "3"])
    assert "step 0: rollout" in out and "step 1: rollout" in out and "Ordered by: internal time" in out


def test_rollout_throughput_paths_agree_at_float32(tmp_path):
    """benchmarks/rollout_throughput.py on the tiny model: the continuous path plays the same
    replies as the current one at float32 (agree = 1), reuses prompt prefixes, and the
    bfloat16 copy's log-prob gap is measured."""
    import json

    _bench(["benchmarks/rollout_throughput.py", "--model", "tiny-random", "--games", "household", "--repeats", "1", "--out", str(tmp_path)])
    (game,) = json.loads((tmp_path / "rollout_throughput.json").read_text())["games"]
    paths = game["paths"]
    assert set(paths) >= {"current", "continuous", "continuous-bf16"}
    assert paths["continuous"]["agree"] == [1.0] and paths["continuous"]["reused_tokens"][0] > 0
    assert paths["current"]["episodes"] == paths["continuous"]["episodes"] == [game["B"] * game["G"]]
    assert paths["continuous-bf16"]["mismatch"] > 0 and (tmp_path / "rollout_throughput.md").exists()


def test_engine_speed_native_matches_the_trainer(tmp_path):
    """benchmarks/engine_speed.py, native engine on the tiny model: the sampler's log-probs are
    the trainer's (float32 rounding only)."""
    import json

    _bench(["benchmarks/engine_speed.py", "--model", "tiny-random", "--engines", "native", "--repeats", "1", "--out", str(tmp_path)])
    native = json.loads((tmp_path / "engine_speed.json").read_text())["engines"]["native"]
    assert len(native["rollout_s"]) == 2 and max(native["mismatch"]) < 1e-4 and sum(native["gen_tokens"]) > 0


def test_gate_simulation_keeps_its_error_budget(tmp_path):
    """benchmarks/gate_simulation.py, few simulations: the gate's false-accept rate has an interval
    that covers the budget's side, and the sample size is the one the power target asks."""
    import json

    out = tmp_path / "gate.json"
    _bench(["benchmarks/gate_simulation.py", "--sims", "50", "--rounds", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    lo, hi = r["false_accept"]["ci95"]
    assert r["settings"]["sims"] == 50 and r["sample_size"] > 0 and lo <= r["settings"]["alpha"] and 0 <= lo <= r["false_accept"]["rate"] <= hi


def _gate_rounds():
    spec = importlib.util.spec_from_file_location("gate_rounds", REPO / "benchmarks" / "gate_rounds.py")
    gr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gr)
    return gr


def _eval_file(path: Path, successes: dict[int, bool]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    k, n = sum(successes.values()), len(successes)
    path.write_text(json.dumps({"success_rate": k / n, "n": n, "ci95": [0.0, 1.0],
                                "items": [{"seed": s, "success": ok, "reward": float(ok)} for s, ok in successes.items()]}))


def test_gate_rounds_collects_the_decisions_and_pairs_by_hand(tmp_path):
    """benchmarks/gate_rounds.py on a hand-made run: the prompt round and the weights gate come
    from metrics.jsonl, the held-out curve from its eval rows; before (1, 0, 0, 1) against after
    (1, 1, 0, 0) is one item won and one lost (diff 0, McNemar p = 1); a baseline that played
    items 2..5 is paired on the three items both played: baseline (0, 0, 0) against after (1, 0, 0)."""
    gr = _gate_rounds()
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/success_rate": 0.5, "eval/n": 4, "eval/ci95_lo": 0.1, "eval/ci95_hi": 0.9},
            {"step": 1, "reward/mean": 0.5},
            {"step": 2, "prompt/proposals": 2.0, "prompt/malformed": 1.0, "prompt/accepted": 0.0, "prompt/p_value": 0.5, "prompt/gain": 0.25},
            {"step": 2, "gate/accepted": 1.0, "gate/rolled_back": 0.0, "gate/p_value": 0.01, "gate/regressions": 0},
            {"step": 2, "eval/success_rate": 0.5, "eval/n": 4, "eval/ci95_lo": 0.1, "eval/ci95_hi": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _eval_file(run / "eval" / "before.json", {1: True, 2: False, 3: False, 4: True})
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps({"heldout": {"items": [{"seed": s, "success": False} for s in (2, 3, 4, 5)]}}))
    with pytest.raises(SystemExit, match="has not finished"):
        gr.summarise(run)
    _eval_file(run / "eval" / "after.json", {1: True, 2: True, 3: False, 4: False})
    out = gr.summarise(run, "examples/x.toml", baseline)
    assert out["command"] == "recursa train examples/x.toml" and [c["step"] for c in out["curve"]] == [0, 2]
    (rnd,) = out["prompt_rounds"]
    assert rnd == {"step": 2, "proposals": 2.0, "malformed": 1.0, "accepted": 0.0, "p_value": 0.5, "gain": 0.25}
    assert out["weight_gates"] == [{"step": 2, "accepted": 1.0, "rolled_back": 0.0, "p_value": 0.01, "regressions": 0}]
    ba, vs = out["paired"]
    assert (ba["n"], ba["diff"], ba["second_only"], ba["first_only"], ba["p_two_sided"]) == (4, 0.0, 1, 1, 1.0)
    assert (vs["n"], vs["first_rate"], vs["second_rate"], vs["second_only"], vs["first_only"]) == (3, 0.0, 1 / 3, 1, 0)
    assert vs["p_second_better"] == pytest.approx(0.5)  # one discordant item, won: P(X >= 1), X ~ Bin(1, 1/2)
    assert vs["diff_ci95"][0] < 0 < 1 / 3 < vs["diff_ci95"][1]
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        gr.summarise(tmp_path / "missing")


def test_gate_rounds_reads_the_proposals_of_a_tiny_gated_run(tmp_path):
    """The demo's prompt gate on the tiny model, one round per step: the script finds each
    round's best proposal in the run's lineage and writes the result file."""
    from recursa.config import load_config
    from recursa.recipes import grpo

    sets = ["model.name=tiny-random", "run.threads=1", "run.checkpoint_every=0", "sampling.max_new_tokens=4", "train.steps=2",
            "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=4", "eval.n=4", "eval.batch_size=4",
            "gate.n=4", "gate.prompt_every=1", "gate.prompt_candidates=2", "gate.prompt_select_n=2", "gate.prompt_max_chars=40"]
    cfg = load_config(REPO / "examples" / "gate_prompt_demo.toml", sets)
    run = grpo.train(cfg, tmp_path / "gated", log=lambda *_: None)
    out = tmp_path / "r.json"
    assert _gate_rounds().main([str(run), "--config", "examples/gate_prompt_demo.toml", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    rounds = r["prompt_rounds"]
    assert [x["step"] for x in rounds] == [1, 2] and r["after"]["n"] == 4 and r["paired"][0]["n"] == 4
    tested = [x for x in rounds if "p_value" in x]
    assert tested and all(isinstance(x["proposal"], str) and x["proposal"] for x in tested)
    assert all("proposal" not in x for x in rounds if "p_value" not in x)  # a round with no usable proposal tests nothing


def test_limits_reports_each_stage_against_its_bound(tmp_path):
    """benchmarks/limits.py on the tiny model: every stage has a positive, finite rate and bound, the
    fraction is their ratio, and each bound is recomputed here from the model's shape and the probes
    (decode: the slower of (weights + KV bytes) / copy bandwidth and FLOPs / matmul rate)."""
    import math

    _bench(["benchmarks/limits.py", "--model", "tiny-random", "--decode-rows", "2,5", "--decode-steps", "2", "--prefill-prompts", "4",
            "--prefill-rows", "2", "--update-rows", "3", "--copy-mb", "32", "--matmul-n", "256", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "limits.json").read_text())
    sh, bw, rate = res["shape"], res["bw_gbs"], res["matmul_gflops"]
    assert bw == max(res["machine_start"]["copy_gbs"], res["machine_end"]["copy_gbs"]) > 0
    assert [(r["stage"], r["dtype"]) for r in res["table"]] == [("decode", "float32")] * 2 + [("decode", "bfloat16")] * 2 + [
        ("prefill", "float32"), ("update", "fp32"), ("update", "bf16")]
    for row in res["table"]:
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("measured", "bound", "fraction")), row
        assert math.isclose(row["fraction"], row["measured"] / row["bound"], rel_tol=1e-9)
    assert all(rec["matmul_before"] > 0 for rec in res["decode"] + res["update"] + [res["prefill"]])
    kv = 2 * sh["layers"] * sh["kv_heads"] * sh["head_dim"]  # elements per position
    attn = 4 * sh["layers"] * sh["heads"] * sh["head_dim"]  # forward FLOPs per (query, key) pair
    for rec in res["decode"]:
        elt = 4 if rec["dtype"] == "float32" else 2
        L, n, s = rec["context"], rec["rows"], rec["steps"]
        nbytes = sum((sh["body"] + sh["vocab"] * sh["hidden"]) * elt + n * kv * (L + k + 1) * elt for k in range(1, s + 1))
        flops = sum(n * (2 * (sh["body"] + sh["vocab"] * sh["hidden"]) + attn * (L + k + 1)) for k in range(1, s + 1))
        assert math.isclose(rec["bytes"], nbytes) and math.isclose(rec["flops"], flops)
        t_bound = max(nbytes / (bw * 1e9), flops / (rate[rec["dtype"]] * 1e9))
        assert math.isclose(rec["bound"], n * s / t_bound, rel_tol=1e-9) and rec["tokens"] == n * s
        assert rec["limit"] == ("memory" if nbytes / bw > flops / rate[rec["dtype"]] else "compute")
    p = res["prefill"]
    assert p["prompts"] == 4 and p["forwards"] == 2 and p["padded_tokens"] >= p["tokens"] > 0
    assert math.isclose(p["bound"], p["tokens"] / (p["flops"] / (rate["float32"] * 1e9)), rel_tol=1e-9)
    assert p["flops"] > 2 * sh["body"] * p["tokens"]  # plus the attention
    for u in res["update"]:
        r = rate["float32" if u["precision"] == "fp32" else "bfloat16"]
        assert u["rows"] == 3 and u["action_tokens"] > 0
        assert math.isclose(u["bound"], u["tokens"] / (u["flops"] / (r * 1e9)), rel_tol=1e-9)
        # 3 x forward: body matmuls of every token run, the projection of every action position, attention
        assert u["flops"] > 3 * (2 * sh["body"] * u["tokens"] + 2 * sh["vocab"] * sh["hidden"] * u["action_tokens"])
        assert math.isclose(u["flops_6n"], 6 * sh["params"] * u["tokens"])
    md = (tmp_path / "limits.md").read_text()
    assert md.startswith("# Each stage against its bound") and "--model tiny-random" in md and md.count("| decode |") == 4


def test_speed_run_table_flags_arms_on_hosts_of_different_bf16(tmp_path):
    """benchmarks/speed_run.py's table from two arms' files: the ratio, the paired test on the
    same games, each arm's bf16 probe, and a warning when one arm's host had native bfloat16 and
    the other's did not (rollout.decode_dtype = "auto" then picks different paths)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("speed_run", REPO / "benchmarks" / "speed_run.py")
    sr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sr)
    host = sr.bf16_host()
    assert set(host) == {"native_bf16", "bf16_gflops", "fp32_gflops_1024"} and host["bf16_gflops"] > 0
    wins = {"old": [True, False, True, False], "new": [True, True, True, False]}
    for arm, wall, native in (("old", 600.0, False), ("new", 200.0, True)):
        d = tmp_path / arm
        (d / "household_light").mkdir(parents=True)
        items = [{"seed": g, "success": w} for g, w in enumerate(wins[arm])]
        (d / "household_light" / f"grpo{sr.TAG}_seed0.json").write_text(json.dumps({"wall_s": wall, "run_dir": str(tmp_path), "heldout": {"items": items, "success_rate": sum(wins[arm]) / 4}}))
        (d / "arm.json").write_text(json.dumps({"commit": arm, "started": wall, "matmul_gflops": {"before": 80, "after": 81},
                                                "host": {"native_bf16": native, "bf16_gflops": 200.0 if native else 0.8, "fp32_gflops_1024": 83.0}}))
    summary = sr.table(tmp_path)
    assert summary["ratio_old_over_new"] == 3.0 and summary["paired"]["b"] == 1 and summary["paired"]["c"] == 0
    text = (tmp_path / "speed_run.md").read_text()
    assert "| 0.8 / 83, no |" in text and "| 200.0 / 83, yes |" in text
    assert "compares hosts, not code" in text
