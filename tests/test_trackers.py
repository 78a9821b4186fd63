"""W&B (offline: its run files read back) and MLflow (a local file store read back through its client)
receive the scalars of metrics.jsonl at their steps and the resolved recipe; a resumed run continues
the same tracked run; a recipe asking for a tracker that is not installed is one error line."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

import mlflow
import pytest
from conftest import finish_ranks, start_ranks
from wandb.proto import wandb_internal_pb2

from common.errors import NonFiniteLoss, RecipeError
from pretrain import faults
from pretrain.metrics import metric_name
from pretrain.trackers import MLFLOW_HTTP_BOUNDS
from pretrain.train import train

BASE = ["train.max_steps=4", "train.eval_every_steps=2", "checkpoint.every_steps=2", "logging.tensorboard=false"]


def wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (7-byte header: crc, length, type 1 full / 2 first / 3 middle / 4 last) form the records."""
    data, pos, block, buf, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_wandb_offline_run_holds_the_scalars_and_resume_continues_it(tmp_path):
    run = tmp_path / "run"
    wb = {"project": "variants", "group": "study", "name": "cell", "tags": ["cpu"], "mode": "offline"}
    train("recipes/tiny_cpu.yaml", [*BASE, f"logging.wandb={json.dumps(wb)}"], run_dir=run, resume="never")
    run_id = json.loads((run / "trackers.json").read_text())["wandb"]
    over = [*BASE, "train.max_steps=6", f"logging.wandb={json.dumps(wb)}"]
    train("recipes/tiny_cpu.yaml", over, run_dir=run, resume="auto")
    assert json.loads((run / "trackers.json").read_text())["wandb"] == run_id
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the first process and the resumed one: one run id
    logged = {r["step"]: r for r in metrics(run)}
    deadline = time.monotonic() + 60  # W&B's service process may still be writing the last file on a busy machine
    while True:
        history, runs, summary = {}, [], {}
        for f in files:
            for rec in wandb_records(f):
                kind = rec.WhichOneof("record_type")
                if kind == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                    history.setdefault(items["_step"], {}).update(items)
                elif kind == "run":
                    runs.append(rec.run)
                elif kind == "summary":
                    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update}
        if sorted(history) == sorted(logged) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(history) == sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, rec in logged.items():  # the names TensorBoard and MLflow use too (metrics.metric_name)
        assert history[step]["train/loss"] == pytest.approx(rec["loss"])
        assert history[step]["train/lr"] == pytest.approx(rec["lr"])
        if "val_loss" in rec:
            assert history[step]["val/loss"] == pytest.approx(rec["val_loss"])
    assert summary["train/loss"] == pytest.approx(logged[6]["loss"])  # the final metrics
    first = runs[0]
    assert (first.run_id, first.project, first.run_group, first.display_name) == (run_id, "variants", "study", "cell")
    assert list(first.tags) == ["cpu"]
    config = {u.key: json.loads(u.value_json) for u in first.config.update}
    assert config["optim"]["lr"] == 3e-3 and config["train"]["max_steps"] == 4  # the resolved recipe


def test_mlflow_file_store_holds_the_scalars_params_and_resume_continues_it(tmp_path):
    run, store = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    ml = {"tracking_uri": store, "experiment": "variants", "group": "study"}
    train("recipes/tiny_cpu.yaml", [*BASE, f"logging.mlflow={json.dumps(ml)}"], run_dir=run, resume="never")
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    over = [*BASE, "train.max_steps=6", f"logging.mlflow={json.dumps(ml)}"]
    train("recipes/tiny_cpu.yaml", over, run_dir=run, resume="auto")
    assert json.loads((run / "trackers.json").read_text())["mlflow"] == run_id
    client = mlflow.tracking.MlflowClient(store)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.tags["group"] == "study"
    assert got.data.params["optim.lr"] == "0.003" and got.info.run_name == "tiny_cpu"
    assert client.get_experiment(got.info.experiment_id).name == "variants"
    logged = {r["step"]: r for r in metrics(run)}
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert loss == pytest.approx({s: r["loss"] for s, r in logged.items()})
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["final_metrics.json", "resolved_recipe.yaml"]
    final = json.loads(open(client.download_artifacts(run_id, "final_metrics.json", str(tmp_path))).read())
    assert final["step"] == 6 and final["train/loss"] == pytest.approx(logged[6]["loss"])
    val = {m.step: m.value for m in client.get_metric_history(run_id, "val/loss")}
    assert val == pytest.approx({s: r["val_loss"] for s, r in logged.items() if "val_loss" in r})
    assert sorted(val) == [2, 4, 6]


def test_a_run_that_fails_is_marked_failed_in_the_trackers(tmp_path, monkeypatch):
    run, store = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    ml, wb = {"tracking_uri": store, "experiment": "variants"}, {"project": "variants", "mode": "offline"}
    monkeypatch.setenv(faults.ENV, json.dumps({"nan_batches": [2]}))  # step 3's loss: NaN
    over = [*BASE, "train.nan_policy=stop", f"logging.mlflow={json.dumps(ml)}", f"logging.wandb={json.dumps(wb)}"]
    with pytest.raises(NonFiniteLoss):
        train("recipes/tiny_cpu.yaml", over, run_dir=run, resume="never")
    ids = json.loads((run / "trackers.json").read_text())
    client = mlflow.tracking.MlflowClient(store)
    assert client.get_run(ids["mlflow"]).info.status == "FAILED"
    assert {m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")} == {1, 2}
    (wandb_file,) = (run / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    deadline = time.monotonic() + 60  # W&B's service process may still be writing the file on a busy machine
    while not (exits := [r.exit.exit_code for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"]):
        assert time.monotonic() < deadline, "no exit record in the W&B run file"
        time.sleep(0.5)
    assert exits == [1]


@pytest.mark.parametrize(
    "key, body, match",
    [
        ("wandb", {"project": "p"}, "the wandb package is not installed. Fix: pip install wandb"),
        ("mlflow", {"tracking_uri": "file:/tmp/x"}, "the mlflow package is not installed. Fix: pip install mlflow"),
        ("wandb", {"projekt": "p"}, r"logging.wandb: unknown keys \['projekt'\]"),
        ("wandb", {"project": "p", "mode": "sometimes"}, "mode must be one of"),
        ("mlflow", {"experiment": "e"}, r"missing \['tracking_uri'\]"),
    ],
)
def test_tracker_settings_and_missing_packages_refused_before_work(tmp_path, monkeypatch, key, body, match):
    if "not installed" in match:
        monkeypatch.setitem(sys.modules, key, None)  # `import wandb` / `import mlflow` now fails
    with pytest.raises(RecipeError, match=match):
        train("recipes/tiny_cpu.yaml", [*BASE, f"logging.{key}={json.dumps(body)}"], run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_mlflow_server_is_one_error_line_or_with_warn_a_local_run(tmp_path, monkeypatch, capsys):
    """A real closed port: the run stops before training with the tracker, the reason and the fix (MLflow's
    retries bounded through its environment); with on_tracker_error=warn it trains and logs locally."""
    for key in MLFLOW_HTTP_BOUNDS:  # absent, and restored after the test (the tracker sets them)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    ml = json.dumps({"tracking_uri": f"http://127.0.0.1:{closed_port()}", "experiment": "e"})
    with pytest.raises(RecipeError, match=r"logging.mlflow: the tracker did not start \(.*\)\. Fix: check that"):
        train("recipes/tiny_cpu.yaml", [*BASE, f"logging.mlflow={ml}"], run_dir=tmp_path / "fail")
    assert all(os.environ[k] == v for k, v in MLFLOW_HTTP_BOUNDS.items())
    res = train(
        "recipes/tiny_cpu.yaml",
        [*BASE, f"logging.mlflow={ml}", "logging.on_tracker_error=warn"],
        run_dir=tmp_path / "warn",
    )
    assert res.final_step == 4 and [r["step"] for r in metrics(tmp_path / "warn") if "loss" in r][-1] == 4
    assert "warning: logging.mlflow: the tracker did not start" in capsys.readouterr().out


def test_a_tracker_that_does_not_start_stops_every_rank_with_its_line(tmp_path):
    """Only rank 0 starts the trackers; two real processes (gloo): the other rank stops with the same
    line, not later with a failed collective (or, where a peer's death is not seen, a hang)."""
    ml = json.dumps({"tracking_uri": f"http://127.0.0.1:{closed_port()}", "experiment": "e"})
    args = ["--recipe", "recipes/tiny_cpu.yaml", "--run-dir", str(tmp_path / "r"), *BASE, f"logging.mlflow={ml}"]
    procs = start_ranks(args, world=2)
    outs = finish_ranks(procs, timeout=240)
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode != 0 and "error: logging.mlflow: the tracker did not start" in out, (rank, out[-2000:])
        assert "collective operation failed" not in out, (rank, out[-2000:])


def test_wandb_online_without_an_api_key_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wb = json.dumps({"project": "p", "mode": "online"})
    with pytest.raises(
        RecipeError, match=r"logging.wandb: the tracker did not start \(UsageError: .*Fix: run `wandb login`"
    ):
        train("recipes/tiny_cpu.yaml", [*BASE, f"logging.wandb={wb}"], run_dir=tmp_path / "r")


def test_one_metric_namespace_for_every_sink():
    names = {
        k: metric_name(k) for k in ("loss", "lr", "val_loss", "val_loss/gcide", "eval/bpb/code", "mfu", "mem_peak_gib")
    }
    assert names == {
        "loss": "train/loss",
        "lr": "train/lr",
        "val_loss": "val/loss",
        "val_loss/gcide": "val/loss/gcide",
        "eval/bpb/code": "eval/bpb/code",
        "mfu": "throughput/mfu",
        "mem_peak_gib": "memory/mem_peak_gib",
    }
