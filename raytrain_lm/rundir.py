"""The layout of a run's directory, in one place: every file a run keeps and who writes it.

`<output_dir>/<name>/` holds:
- `checkpoint_*/`: Ray Train's checkpoint folders (see trainer/checkpoint.py for their contents);
- `config.yaml`: the run's config, secrets redacted (driver, at every start);
- `tokenizer.json`: the tokenizer the data was prepared with (driver);
- `tracking.json`: which MLflow run and store belong to the run (driver);
- `events.jsonl`, `heartbeat.json`: goodput's event log and rank 0's heartbeat (trainer/goodput.py);
- `ledger/`: the sequence positions each rank consumed (data/ledger.py);
- `summary.json`: the figures of the finished run (driver);
- `STOP`: a stop request from the driver, read by rank 0 (trainer/signals.py);
- `checkpoint_manager_snapshot.json`: Ray Train's own list of reported checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TRACKING_FILE = "tracking.json"
SUMMARY_FILE = "summary.json"
EVENTS_FILE = "events.jsonl"
HEARTBEAT_FILE = "heartbeat.json"
STOP_FILE = "STOP"
LEDGER_DIR = "ledger"
CHECKPOINT_PREFIX = "checkpoint_"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def of(cls, output_dir: str | Path, name: str) -> RunDir:
        return cls(Path(output_dir) / name)

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER_FILE

    @property
    def tracking(self) -> Path:
        return self.path / TRACKING_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_FILE

    @property
    def ray_train_snapshot(self) -> Path:
        return self.path / RAY_TRAIN_SNAPSHOT

    def checkpoint_folders(self) -> list[Path]:
        return [p for p in self.path.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir()]

    def is_run(self) -> bool:
        """Whether a run was ever started here (it has a tracking record or events)."""
        return (self.path / TRACKING_FILE).is_file() or (self.path / EVENTS_FILE).is_file()

    def __str__(self) -> str:
        return str(self.path)
