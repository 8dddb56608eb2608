"""The run report (swift_megatron/report): smoothing, tolerant log reading, metric grouping,
completion sampling, and the whole report from a synthetic run directory (PNG sizes,
summary.md, completions.html escaping and rendering), with and without matplotlib."""
import json
import os
import struct

import pytest

from swift_megatron import report
from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.report.completions_view import Entry, embed_json, sample, spread
from swift_megatron.report.groups import grouped, reward_notes
from swift_megatron.report.plots import figure_pixels, grid, plotted_keys
from swift_megatron.report.records import MetricLog, plottable, read_metric_log, wall_time_s
from swift_megatron.report.run_record import read_run_record, record_run
from swift_megatron.report.smoothing import half_width, smooth
from swift_megatron.report.summary import duration, unplotted_line

STEPS = 12
FUNCS = ("digit_ratio", "contains_answer")


# ---- synthetic run directory ----------------------------------------------------------------

def metric_line(step: int) -> dict:
    row = {"step": step, "time": 1000.0 + 10 * step, "reward/mean": 0.05 * step,
           "reward/std": 0.3, "loss/policy": 0.1 - 0.01 * step, "grad_norm": 1.0 / step,
           "entropy": 5.0, "time/rollout_s": 4.0, "time/train_s": 2.0,
           "rollout/completion_length_max": 12}
    row.update({f"reward/{name}/mean": 0.5 for name in FUNCS})
    row["kl"] = None if step == 5 else 0.01 * step        # non-finite: logged as null
    if step % 4 == 0:
        row["eval/reward/mean"] = 0.1 * step              # a key missing from most lines
    return row


def completion_line(step: int, group: int, k: int) -> dict:
    reward = 0.25 * k
    return {"step": step, "prompt_id": group, "prompt": f"What is {group} + 1?",
            "completion": f"It is </script><script>alert({k})</script> & {k}", "reward": reward,
            "rewards": {"digit_ratio": reward, "contains_answer": None},
            "advantage": reward - 0.375,
            "length": 12, "truncated": k == 0}


@pytest.fixture
def run_dir(tmp_path):
    """A killed run: 12 steps, a half-written 13th line, 12 x 2 groups x 4 completions."""
    with open(tmp_path / "logging.jsonl", "w") as f:
        f.writelines(json.dumps(metric_line(s)) + "\n" for s in range(1, STEPS + 1))
        f.write('{"step": 13, "time": 11')
    with open(tmp_path / "completions.jsonl", "w") as f:
        f.writelines(json.dumps(completion_line(s, g, k)) + "\n"
                     for s in range(1, STEPS + 1) for g in range(2) for k in range(4))
    return tmp_path


def png_size(path) -> tuple:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


# ---- pure parts -------------------------------------------------------------------------------

def test_smoothing_is_centred_and_does_not_lag_at_the_ends():
    """issue 57: the debiased EMA ended the demo's reward curve at 0.43 where the last value was
    0.505; the centred window, shrinking at the ends, ends on the last value and leaves a
    straight line as it is."""
    assert [half_width(w) for w in (0.0, 0.5, 0.6, 0.9)] == [0, 1, 2, 9]
    assert smooth([0.0, 1.0, 2.0, 3.0, 10.0], 0.6) == [0.0, 1.0, 3.2, 5.0, 10.0]
    rising = [0.1 * i for i in range(12)] + [0.505]
    assert smooth(rising, 0.6)[-1] == 0.505 and smooth(rising, 0.9)[-1] == 0.505
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.9) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert smooth([1.0, None, 2.0, 6.0], 0.6) == [1.0, None, 3.0, 6.0]   # null: kept, skipped
    assert smooth([3.0, 1.0, 4.0], 0.0) == [3.0, 1.0, 4.0]               # weight 0: the values
    assert smooth([], 0.6) == []
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        smooth([1.0], 1.0)


def test_read_metric_log_tolerates_killed_and_resumed_runs(tmp_path):
    path = tmp_path / "logging.jsonl"
    path.write_text('{"step": 2, "time": 20.0, "a": 2.0}\n'
                    'not json\n'
                    '{"step": 1, "time": 10.5, "a": null, "b": "text", "c": true}\n'
                    '{"step": 2, "time": 30.0, "a": 5, "time/rollout_s": 3.5}\n'
                    '\n'
                    '{"step": 3, "a": 1.')
    log = read_metric_log(str(path))
    assert log.bad_lines == 2
    assert [r["step"] for r in log.records] == [1, 2]
    assert log.series("a") == ([1, 2], [None, 5.0])              # resumed step 2: last line wins
    assert log.keys() == ["a", "time/rollout_s"]                 # text and bools are not metrics
    assert wall_time_s(log) == pytest.approx(30.0 - 10.5)


def test_wall_time_counts_the_first_steps_phases(run_dir):
    log = read_metric_log(str(run_dir / "logging.jsonl"))
    assert wall_time_s(log) == pytest.approx(1120.0 - 1010.0 + 6.0)
    assert duration(116.0) == "1m 56s" and duration(3725.2) == "1h 02m 05s"
    assert duration(4.25) == "4.2s"


def test_grouping_follows_the_table_and_collects_the_rest():
    keys = ["reward/mean", "reward/b/mean", "reward/a/mean", "reward/a/std", "kl", "loss/policy",
            "clip_ratio/low", "time/train_s", "eval/reward/mean", "custom/thing"]
    groups = {g.name: found for g, found in grouped(keys)}
    assert groups == {"overview": ["reward/mean", "kl", "loss/policy"],
                      "reward": ["reward/mean"],
                      "reward_functions": ["reward/a/mean", "reward/b/mean", "reward/a/std"],
                      "policy": ["loss/policy", "kl"], "clipping": ["clip_ratio/low"],
                      "time": ["time/train_s"], "eval": ["eval/reward/mean"],
                      "other": ["custom/thing"]}
    only = {g.name: found for g, found in grouped(keys, ["reward/*/mean"])}
    assert only == {"reward_functions": ["reward/a/mean", "reward/b/mean"]}


def test_grid_and_figure_size():
    assert [grid(n) for n in (1, 3, 4, 5, 7)] == [(1, 1), (1, 3), (2, 2), (2, 3), (3, 3)]
    assert figure_pixels(4) == (900, 600) and figure_pixels(6) == (1350, 600)


def test_only_changing_series_are_plotted_the_rest_written_out(run_dir):
    """issue 57: clipping.png was three boxes of text ("0 at every one of 2 steps") and
    other.png drew a metric logged once as a dot; such metrics get no panel (a group left
    without any, no figure) and summary.md's "Not plotted" gives their values."""
    assert plottable([0.1, None, 0.2]) and not plottable([0.0, None, 0.0, 0.0])
    assert not plottable([2.0]) and not plottable([None, None]) and not plottable([])
    log = MetricLog("x", [{"step": s, "clip_ratio/low": 0.0, "loss/policy": 0.1 * s,
                           "numerics/gap": 0.25 if s == 2 else None, "kl": None}
                          for s in (2, 3, 4)])
    assert plotted_keys(log, ["clip_ratio/low", "loss/policy", "numerics/gap", "kl"]) == \
        ["loss/policy"]
    assert [unplotted_line(log, k) for k in ("clip_ratio/low", "numerics/gap", "kl")] == [
        "- `clip_ratio/low`: 0 at each of the 3 logged steps (2 to 4)",
        "- `numerics/gap`: 0.25, logged once (step 2); null at 2 other step(s)",
        "- `kl`: no finite value (null at 3 step(s))"]


def test_a_reward_of_weight_0_is_marked_not_trained():
    record = {"flags": {"reward_funcs": ["digit_ratio", "contains_answer"],
                        "reward_weights": [1.0, 0.0]}}
    keys = ["reward/mean", "reward/digit_ratio/mean", "reward/contains_answer/mean",
            "reward/contains_answer/std", "eval/reward/contains_answer/mean"]
    assert reward_notes(keys, record) == {k: "weight 0: not trained" for k in keys[2:]}
    assert reward_notes(keys, {"flags": {"reward_funcs": ["a"], "reward_weights": None}}) == {}
    assert reward_notes(keys, None) == {}


def test_sampling_keeps_every_step_and_whole_groups():
    entries = [Entry(line=10 * s + i, step=s, group=str(i // 4), reward=float(i % 4))
               for s in range(3) for i in range(8)]
    assert sample(entries, limit=24) == entries                   # under the limit: everything
    lines = [e.line for e in sample(entries, limit=12)]           # 4 a step: the first group
    assert lines == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    # a share smaller than one group: its best, worst and middle completions
    picked = sample(entries, limit=9)
    assert [(e.step, e.reward) for e in picked] == \
        [(s, r) for s in range(3) for r in (0.0, 1.0, 3.0)]
    assert spread(10, 4) == [0, 3, 6, 9] and spread(3, 5) == [0, 1, 2]


def test_embedded_json_cannot_close_the_script():
    text = embed_json({"c": "</script><!-- & \u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"c": "</script><!-- & \u2028"}


# ---- the whole report -----------------------------------------------------------------------

def rlhf_args():
    return parse_command(RlhfArguments, ["--model", "tiny", "--dataset", "math.jsonl",
                                         "--reward_funcs", *FUNCS, "--beta", "0"], "megatron rlhf")


def test_record_run_writes_flat_flags_and_changes(run_dir):
    record_run(str(run_dir), "megatron rlhf", rlhf_args(), None, train_iters=20)
    record = read_run_record(str(run_dir))
    assert record["given"] == ["model", "dataset", "beta", "reward_funcs"]
    assert record["flags"]["reward_funcs"] == list(FUNCS) and record["train_iters"] == 20
    assert record["flags"]["micro_batch_size"] == 1 and record["batch_plan"] is None


def test_report_from_a_killed_run(run_dir):
    record_run(str(run_dir), "megatron rlhf", rlhf_args(), None, train_iters=20)
    written = report.write_report(str(run_dir))
    names = {os.path.basename(p): p for p in written.plots}
    # constant metrics (reward/std, entropy, time/*, ...) get no panel, a group of them no figure
    panels = {"overview": 4, "reward": 1, "policy": 3, "eval": 1}
    assert sorted(names) == sorted(f"{g}.png" for g in panels)
    for group, count in panels.items():
        path = names[f"{group}.png"]
        assert png_size(path) == figure_pixels(count) and os.path.getsize(path) > 5000
    summary = open(written.summary).read()
    assert "- 12 logged steps, step 1 to 12 of 20: stopped or still running" in summary
    assert "wall time 1m 56s" in summary
    assert "| `kl` | 0.01 | 0.12 | 0.01 | 0.12 |  | 1 |" in summary          # one null step
    assert "| `reward/mean` | 0.05 | 0.6 | 0.05 | 0.6 | 0.6 (step 12) |  |" in summary
    assert "megatron rlhf \\\n    --model tiny \\\n    --dataset math.jsonl \\\n" \
           "    --beta 0.0 \\\n    --reward_funcs digit_ratio contains_answer\n" in summary
    assert "1 unreadable line(s) of logging.jsonl skipped" in summary
    assert "all 96 completions" in summary and "![policy](policy.png)" in summary
    assert "- `time/train_s`: 2 at each of the 12 logged steps (1 to 12)" in summary
    assert "![time](time.png)" not in summary


def test_report_without_matplotlib(run_dir, monkeypatch, swift_logs):
    monkeypatch.setattr(report, "matplotlib_available", lambda: False)
    (run_dir / "report").mkdir()
    (run_dir / "report" / "kl.png").write_bytes(b"not ours")        # not a group name: kept
    (run_dir / "report" / "policy.png").write_bytes(b"stale")        # an earlier report's: removed
    written = report.write_report(str(run_dir))
    assert written.plots == [] and sorted(os.listdir(run_dir / "report")) == \
        ["completions.html", "kl.png", "summary.md"]
    assert "Flags\n\nNot recorded: args.json is missing" in open(written.summary).read()
    warnings = [r.getMessage() for r in swift_logs.records if r.levelname == "WARNING"]
    assert warnings == ["report: matplotlib is not installed, so no plots (pip install matplotlib)"]


def test_user_errors_name_the_path(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path}/logging.jsonl not found"):
        report.write_report(str(tmp_path))
    (tmp_path / "logging.jsonl").write_text('{"step": 1, "ti')
    with pytest.raises(UserError, match="has no logged step yet"):
        report.write_report(str(tmp_path))
    (tmp_path / "logging.jsonl").write_text('{"step": 1, "kl": 0.5}\n')
    with pytest.raises(UserError, match="--metrics reward/\\*: no logged metric matches "
                                        "\\(logged: kl\\)"):
        report.write_report(str(tmp_path), ["reward/*"])


def test_trainer_hook_never_raises(tmp_path, swift_logs):
    assert report.write_run_report(str(tmp_path), rlhf_args(), None, 10) is None
    warning = [r.getMessage() for r in swift_logs.records if r.levelname == "WARNING"][-1]
    assert warning.startswith("report not written (UserError: ") and "megatron plot" in warning
    assert read_run_record(str(tmp_path))["train_iters"] == 10    # the record was still written


def test_a_save_before_the_first_logged_step_is_no_warning(tmp_path, swift_logs):
    """issue 57: a healthy run with --save_steps < --logging_steps warned 'report not written'
    at its first save (logging.jsonl open, still empty); the next save's report covers it."""
    (tmp_path / "logging.jsonl").write_text("")
    assert report.write_run_report(str(tmp_path), rlhf_args(), None, 10) is None
    assert not [r for r in swift_logs.records if r.levelname == "WARNING"]
    (tmp_path / "logging.jsonl").write_text('{"step": 2, "kl": 0.5}\n')
    assert report.write_run_report(str(tmp_path), rlhf_args(), None, 10) is not None


def test_completions_page_escapes_and_renders(run_dir, tmp_path):
    page = report.write_report(str(run_dir)).completions
    text = open(page).read()
    assert text.count("<script") == 3 and text.count("</script>") == 3  # the page's own three
    data = json.loads(text.split('id="data">')[1].split("</script>")[0])
    assert len(data["rows"]) == 96 and data["funcs"] == list(FUNCS)
    assert data["rows"][0]["completion"] == "It is </script><script>alert(0)</script> & 0"
    assert data["rows"][0]["rewards"] == [0.0, None] and len(data["prompts"]) == 2
    dom = rendered_dom(page, tmp_path)
    if dom is not None:  # Chromium ran the page's script: it opens on the last step
        last = max(r["step"] for r in data["rows"])
        shown = sum(r["step"] == last for r in data["rows"])
        assert dom.count('<tr class="completion">') == min(shown, 20)
        assert f"({shown} completions)" in dom and "<script>alert" not in dom


def test_completions_page_logic_sorts_searches_and_opens_on_the_last_step(run_dir):
    """The page's pure logic (its `logic` script) in a JavaScript engine (QuickJS, a test
    dependency; issue 40): sort by reward or advantage either way with nulls last and ties kept
    in order, search the completions only or the prompts too, within a step; the last step is
    the one the page opens on."""
    import quickjs

    page = report.write_report(str(run_dir)).completions
    logic = open(page).read().split('<script id="logic">')[1].split("</script>")[0]
    rows = [dict(step=1, reward=0.5, advantage=None, completion="alpha", p=0),
            dict(step=2, reward=None, advantage=1.0, completion="beta", p=0),
            dict(step=2, reward=0.9, advantage=-1.0, completion="Gamma", p=1),
            dict(step=3, reward=0.5, advantage=0.5, completion="delta", p=1)]
    prompts = ["find the gamma", "other"]
    probe = logic + """
    var rows = %s, prompts = %s, L = CompletionsLogic;
    function names(list) { return list.map(function (r) { return r.completion; }); }
    function find(step, q, only) { return names(rows.filter(function (r) {
      return L.matches(r, prompts[r.p], step, q, only); })); }
    JSON.stringify({
      reward_high: names(L.sortRows(rows, "reward:-1")), reward_low: names(L.sortRows(rows, "reward:1")),
      advantage_high: names(L.sortRows(rows, "advantage:-1")), kept: names(L.sortRows(rows, "")),
      gamma_anywhere: find("", "gamma", false), gamma_completions: find("", "GAMMA", true),
      step2: find("2", "", false), last: L.lastStep(rows)});
    """ % (json.dumps(rows), json.dumps(prompts))
    found = json.loads(quickjs.Context().eval(probe))
    assert found["reward_high"] == ["Gamma", "alpha", "delta", "beta"]   # ties in order, null last
    assert found["reward_low"] == ["alpha", "delta", "Gamma", "beta"]
    assert found["advantage_high"] == ["beta", "delta", "Gamma", "alpha"]
    assert found["kept"] == ["alpha", "beta", "Gamma", "delta"]
    assert found["gamma_anywhere"] == ["alpha", "beta", "Gamma"]   # prompt 0 says gamma
    assert found["gamma_completions"] == ["Gamma"] and found["step2"] == ["beta", "Gamma"]
    assert found["last"] == 3


def rendered_dom(page, tmp_path):
    """The DOM after the page's scripts ran in headless Chromium (no console message allowed),
    or None where Chromium is not installed (then the structure is checked with html.parser)."""
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        check_structure(open(page).read())
        return None
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-quic", "--no-first-run", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'chromium'}", "--enable-logging=stderr",
                           "--v=0", "--dump-dom", f"file://{page}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    return proc.stdout


def check_structure(text):
    from html.parser import HTMLParser

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids = set()

        def handle_starttag(self, tag, attrs):
            self.ids.update(value for name, value in attrs if name == "id")

    parser = Tags()
    parser.feed(text)
    assert {"step", "search", "only", "sort", "size", "prev", "next", "rows", "data", "info",
            "logic"} <= parser.ids


# ---- the command ------------------------------------------------------------------------------

def test_plot_command_on_a_killed_run(run_dir):
    """issue 57: --metrics 'reward/*' deleted the report's other figures (and would have
    overwritten overview.png with a part of it): it draws report/selected.png alone now."""
    import subprocess
    import sys

    def plot(*flags):
        proc = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", "plot",
                               str(run_dir), *flags], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    report_dir = run_dir / "report"
    assert plot() == [str(report_dir / name) for name in (
        "overview.png", "reward.png", "policy.png", "eval.png", "completions.html",
        "summary.md")]
    before = {name: (report_dir / name).read_bytes() for name in os.listdir(report_dir)}
    assert plot("--metrics", "reward/*", "kl", "--smoothing", "0.9") == \
        [str(report_dir / "selected.png")]
    assert png_size(report_dir / "selected.png") == figure_pixels(2)   # reward/mean, kl
    assert {name: (report_dir / name).read_bytes() for name in before} == before


def test_plot_command_user_errors(tmp_path):
    from swift_megatron.cli.main import run

    with pytest.raises(UserError, match="give the run's directory"):
        run(["plot"])
    with pytest.raises(UserError, match="--smoothing 1.5: must be in"):
        run(["plot", str(tmp_path), "--smoothing", "1.5"])
    with pytest.raises(UserError, match=f"{tmp_path / 'missing'}/logging.jsonl not found"):
        run(["plot", str(tmp_path / "missing")])
    (tmp_path / "logging.jsonl").write_text("")
    with pytest.raises(UserError, match="has no logged step yet"):
        run(["plot", str(tmp_path)])
    (tmp_path / "logging.jsonl").write_bytes(b"garbage\n\x00\xff{not json\n[1, 2]\n")
    with pytest.raises(UserError, match=r"is not a run's log: none of its 3 line\(s\) is a "
                                        r"logged step"):   # issue 40: it said "no step yet"
        run(["plot", str(tmp_path)])


def test_plot_help_imports_neither_torch_nor_matplotlib():
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "from swift_megatron.cli.main import run\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: run(['plot', '--help'])\n"
            "    except SystemExit: pass\n"
            "assert '--metrics' in out.getvalue()\n"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_nan_in_the_log_is_null_not_a_crash(tmp_path):
    """logging.jsonl never holds NaN (MetricsLogger writes null), but a hand-made file may."""
    (tmp_path / "logging.jsonl").write_text('{"step": 1, "kl": NaN}\n{"step": 2, "kl": 1.0}\n')
    log = read_metric_log(str(tmp_path / "logging.jsonl"))
    assert log.series("kl") == ([1, 2], [None, 1.0])
