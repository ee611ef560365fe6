"""Experiment trackers beside TensorBoard (``logging.trackers``): W&B, MLflow and a CSV file, each written through
its own library, by rank 0 only (``RunLogger`` opens them where it is enabled).

Each tracker gets what TensorBoard gets: every scalar of a record (``log_scalars``; the train records' names bare,
the others' as ``<kind>/<name>``, e.g. ``eval/cls_acc``), the resolved config (``log_config``) and the sample captions
(``log_text``). The libraries' own environment variables are honoured and never overridden (``WANDB_MODE``,
``WANDB_DIR``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ...); where one is unset, the
default lies inside output_dir: wandb writes under ``output_dir/wandb`` (project ``mtl``), mlflow into the local store
``sqlite:///<output_dir>/mlflow.db`` with its artifacts in ``output_dir/mlartifacts`` (MLflow 3 refuses a new
``./mlruns`` file store; experiment ``logging.group``, else ``mtl``; ``logging.mlflow_dir`` puts the store in another
folder, as a benchmark sweep does so that its runs are one experiment in one store), csv into ``output_dir/metrics.csv`` and
``output_dir/samples.csv``.

A resumed run continues the same tracker run: ``output_dir/trackers.json`` keeps, for this folder's run (its id in
``run.json``), the W&B run id (resumed with ``resume="allow"``) and the MLflow run id.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import time

from mtl.config.effective import in_effect
from mtl.errors import ConfigError
from mtl.files import write_atomic
from mtl.setup.checks import TRACKERS

STATE_FILE = "trackers.json"  # {"run_id": this folder's run, "wandb": its W&B run id, "mlflow": its MLflow run id}
__all__ = ["TRACKERS", "STATE_FILE", "open_trackers", "prepare_mlflow_store", "scalars"]


def scalars(values: dict, kind: str) -> dict[str, float]:
    """The values TensorBoard gets as scalars (numbers, not booleans), named as it names them."""
    prefix = "" if kind == "train" else f"{kind}/"
    return {prefix + k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class CsvTracker:
    """``metrics.csv``: one row per scalar (step, name, value); ``samples.csv``: one row per sample text. The config
    is ``config.yaml`` beside them. A resumed run first drops the rows after its checkpoint's step."""

    def __init__(self, output_dir: str, start_step: int):
        self.paths = {"metrics": os.path.join(output_dir, "metrics.csv"), "samples": os.path.join(output_dir, "samples.csv")}
        self.files = {}
        for name, path in self.paths.items():
            _trim_csv(path, start_step)
            fresh = not os.path.isfile(path) or os.path.getsize(path) == 0
            f = self.files[name] = open(path, "a", encoding="utf-8", newline="")
            if fresh:
                csv.writer(f).writerow(["step", "name", "value"] if name == "metrics" else ["step", "name", "text"])
                f.flush()

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        csv.writer(self.files["metrics"]).writerows([step, k, repr(v)] for k, v in values.items())
        self.files["metrics"].flush()

    def log_config(self, config: dict) -> None:
        """Nothing: the resolved config is output_dir/config.yaml."""

    def log_text(self, step: int, name: str, text: str) -> None:
        csv.writer(self.files["samples"]).writerow([step, name, text])
        self.files["samples"].flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _trim_csv(path: str, step: int) -> None:
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    keep = rows[:1] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
    if len(keep) != len(rows):
        out = io.StringIO()
        csv.writer(out).writerows(keep)
        write_atomic(path, out.getvalue().encode("utf-8"))


class WandbTracker:
    """A W&B run (``wandb.init``), continued by its id on resume (``resume="allow"``)."""

    def __init__(self, output_dir: str, config: dict, group: str | None, run_id: str | None):
        import wandb

        self.wandb = wandb
        env = os.environ
        with _refused("wandb", wandb.errors.Error, "log in (`wandb login`, or WANDB_API_KEY), or log offline with "
                      "WANDB_MODE=offline (then `wandb sync`)"):
            self.run = self._init(wandb, env, output_dir, config, group, run_id)
        self.id = self.run.id

    @staticmethod
    def _init(wandb, env, output_dir: str, config: dict, group: str | None, run_id: str | None):
        return wandb.init(
            project=None if env.get("WANDB_PROJECT") else "mtl",
            dir=None if env.get("WANDB_DIR") else output_dir,
            name=None if env.get("WANDB_NAME") else os.path.basename(os.path.abspath(output_dir)),
            group=group or None, id=run_id, resume="allow", config=config,
            settings=wandb.Settings(console="off"),  # the run's console is its own (the progress bar, the messages)
        )

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_text(self, step: int, name: str, text: str) -> None:
        self.run.log({name: self.wandb.Table(columns=["text"], data=[[text]])}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run, through ``MlflowClient``: metrics by step, the config as params (flat, dotted keys) and as
    ``config.json``, each sample text as ``samples/step_<step>.md``; continued by its run id on resume."""

    def __init__(self, output_dir: str, config: dict, group: str | None, run_id: str | None, store: str | None = None):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        from mlflow.exceptions import MlflowException

        with _refused("mlflow", (MlflowException, OSError), "check MLFLOW_TRACKING_URI (unset: a local store in "
                      "output_dir, or logging.mlflow_dir)"):
            self.client = client = MlflowClient(tracking_uri=local_store(store or output_dir)[0])
            run = _existing_run(client, run_id)
            if run is None:
                experiment_id = _experiment(client, store or output_dir, group)
                tags = {"mtl.output_dir": os.path.abspath(output_dir), **({"mtl.group": group} if group else {})}
                run = client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(output_dir)), tags=tags)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
        self.id = run.info.run_id
        self.logged_params = dict(run.data.params)

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.id, metrics=metrics[i:i + 1000])

    def log_config(self, config: dict) -> None:
        """Params are immutable in MLflow: a resumed run adds the keys it did not log; config.json is the whole."""
        params = [self.Param(k, v[:6000]) for k, v in _flat(config).items() if k not in self.logged_params]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.id, params=params[i:i + 100])
        self.logged_params.update({p.key: p.value for p in params})
        self.client.log_dict(self.id, config, "config.json")

    def log_text(self, step: int, name: str, text: str) -> None:
        self.client.log_text(self.id, text, f"{name}/step_{step:08d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.id)


@contextlib.contextmanager
def _refused(name: str, errors, fix: str):
    """A tracker that cannot start its run (offline with no login, an unreachable server): one ConfigError naming
    the tracker, its library's reason (first line) and the fix, instead of the library's traceback."""
    try:
        yield
    except errors as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"logging.trackers: {name} could not start its run ({reason}); {fix}, or remove {name} from "
                          "logging.trackers. The run folder keeps what it holds: start again with resume=auto") from None


def local_store(folder: str) -> tuple[str | None, str | None]:
    """(tracking URI, artifact location) of the local MLflow store in ``folder``: (None, None) where
    MLFLOW_TRACKING_URI is set (MLflow's own choice then). MLflow 3 refuses a new file store: its local default is a
    SQLite file, the artifacts in a folder beside it."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None, None
    here = os.path.abspath(folder)
    return "sqlite:///" + os.path.join(here, "mlflow.db"), "file://" + os.path.join(here, "mlartifacts")


def _experiment(client, folder: str, group: str | None) -> str:
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or group or "mtl"
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=local_store(folder)[1])


def prepare_mlflow_store(folder: str, group: str | None) -> None:
    """Create the local store in ``folder`` and the experiment ``group`` before several runs write to it at once:
    MLflow creates a SQLite store's tables on first use, and two processes doing that together fail ("table
    experiments already exists"); once made, concurrent runs write to it safely."""
    from mlflow.tracking import MlflowClient

    os.makedirs(folder, exist_ok=True)
    _experiment(MlflowClient(tracking_uri=local_store(folder)[0]), folder, group)


def _existing_run(client, run_id: str | None):
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except Exception:  # noqa: BLE001 - mlflow's own error for a run its store does not hold (deleted, another store)
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _flat(node, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict) and node:
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): json.dumps(node) if not isinstance(node, str) else node}


def _read_state(output_dir: str, run_id: str | None) -> dict:
    """The tracker run ids this folder's run (``run_id``) started before; {} for a new run."""
    try:
        with open(os.path.join(output_dir, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and run_id and state.get("run_id") == run_id else {}


def _folder_run_id(output_dir: str) -> str | None:
    try:
        with open(os.path.join(output_dir, "run.json"), encoding="utf-8") as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def open_trackers(cfg, start_step: int) -> list:
    """The trackers ``logging.trackers`` names besides TensorBoard (which ``RunLogger`` writes itself), each given
    the resolved config; their run ids saved in ``output_dir/trackers.json``."""
    names = list(cfg.logging.trackers)
    if not any(n in names for n in ("wandb", "mlflow", "csv")):
        return []
    out, group = cfg.output_dir, cfg.logging.group
    run_id = _folder_run_id(out)
    state = _read_state(out, run_id)
    config = in_effect(cfg)
    trackers = []
    for name in dict.fromkeys(names):
        if name == "csv":
            trackers.append(CsvTracker(out, start_step))
        elif name in ("wandb", "mlflow"):
            kind = WandbTracker if name == "wandb" else MlflowTracker
            store = (cfg.logging.mlflow_dir,) if name == "mlflow" else ()
            tracker = kind(out, config, group, state.get(name), *store)
            state[name] = tracker.id
            trackers.append(tracker)
    if "wandb" in state or "mlflow" in state:
        write_atomic(os.path.join(out, STATE_FILE), json.dumps({**state, "run_id": run_id}, indent=1).encode("utf-8"))
    for tracker in trackers:
        tracker.log_config(config)
    return trackers
