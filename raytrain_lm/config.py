"""One typed config tree for a run, loaded from YAML plus dotted overrides.

Components receive only their own section (`build_model(cfg.model)`, `prepare(cfg.data)`,
`BatchPlan.derive(cfg.training)`, `ensure_ray(cfg.scaling)`, ...); only the orchestrators that
wire them together (the driver in trainer/launch.py, the worker loop, the sweep driver) hold
the whole tree. The defaults below *are* the embedded demo: `raytrain-lm train` with no
arguments trains on them.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from raytrain_lm.errors import UserError
from raytrain_lm.redaction import redact_tree

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_TRACKING_DB = "mlflow.db"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Named shapes (`model.preset`). Keys set beside a preset win over its values. Parameter counts
# depend on the tokenizer's vocabulary; the names give them at the vocabularies they were made
# for (GPT-2's 50,257 for 125m, Llama 3's 128,256 for 1b, Llama 2's 32,000 for 7b).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
             "block_size": 64},
    "125m": {"arch": "llama", "n_layer": 12, "n_head": 12, "n_kv_head": 12, "n_embd": 768,
             "ffn_hidden": 2048, "block_size": 1024},
    "1b": {"arch": "llama", "n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048,
           "ffn_hidden": 8192, "block_size": 2048, "rope_theta": 500_000.0},
    "7b": {"arch": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 32, "n_embd": 4096,
           "ffn_hidden": 11008, "block_size": 4096, "tie_embeddings": False},
}  # fmt: skip


class ModelConfig(_Section):
    """The architecture and its shape. `vocab_size` comes from the tokenizer unless set (it must
    then be large enough). `preset` fills the shape from MODEL_PRESETS."""

    arch: Literal["gpt2", "llama"] = Field(
        "gpt2", description="gpt2: LayerNorm, GELU, learned positions; llama: RMSNorm, SwiGLU, RoPE"
    )
    preset: Literal["tiny", "125m", "1b", "7b"] | None = Field(
        None, description="a named shape (MODEL_PRESETS); keys set beside it win"
    )
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_kv_head: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention); n_head if unset"
    )
    n_embd: int = Field(128, ge=8)
    ffn_hidden: int | None = Field(
        None, ge=1, description="MLP width; gpt2: 4 * n_embd, llama: 8/3 * n_embd if unset"
    )
    block_size: int = Field(128, ge=2, description="context length in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = False
    tie_embeddings: bool = Field(True, description="output projection shares the token embedding")
    rope_theta: float = Field(10_000.0, gt=0.0, description="llama: RoPE base")
    norm_eps: float = Field(1e-5, gt=0.0, description="llama: RMSNorm epsilon")
    vocab_size: int | None = Field(None, ge=2)
    init_from: str | None = Field(
        None,
        description="a transformers folder (LlamaForCausalLM, GPT2LMHeadModel) to start from: "
        "its shape, weights and tokenizer (docs/export.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        # an unknown name is left to the field's own check, which names it and the closest
        if isinstance(data, dict) and data.get("preset") in MODEL_PRESETS:
            return {**MODEL_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _shape_is_consistent(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.arch == "gpt2":
            unsupported = {
                "n_kv_head": self.n_kv_head not in (None, self.n_head),
                "tie_embeddings": not self.tie_embeddings,
                "ffn_hidden": self.ffn_hidden not in (None, 4 * self.n_embd),
                "norm_eps": self.norm_eps != 1e-5,
            }
            for key, used in unsupported.items():
                if used:
                    raise ValueError(f"model.{key} is a llama setting: set model.arch=llama")
        else:
            if self.n_head % (self.n_kv_head or self.n_head):
                raise ValueError(
                    f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head "
                    f"({self.n_kv_head})"
                )
            if (self.n_embd // self.n_head) % 2:
                raise ValueError(
                    f"llama's rotary embeddings need an even head size: model.n_embd "
                    f"({self.n_embd}) / model.n_head ({self.n_head}) is odd"
                )
            if self.dropout or self.bias:
                raise ValueError("llama has no dropout or biases: unset model.dropout, model.bias")
        return self


class TokenizerConfig(_Section):
    kind: Literal["byte", "char", "bpe"] = "byte"
    path: str | None = Field(None, description="tokenizer.json to load (bpe); trained if unset")
    vocab_size: int = Field(4096, ge=260, description="target vocabulary when training BPE")


class DataConfig(_Section):
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:python-stdlib"],
        description="text files, folders or globs; builtin:python-stdlib / builtin:python-docs",
    )
    prepared: str | None = Field(
        None, description="train on this folder written by `raytrain-lm prepare`; sources unused"
    )
    text_field: str = Field("text", description="JSON Lines field / Parquet column holding text")
    cache_dir: str = Field("data", description="where prepared datasets go (a path or a URI)")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    val_max_tokens: int | None = Field(
        20_000_000, ge=2, description="cap on validation tokens taken from the stream's tail"
    )
    max_source_bytes: int | None = Field(
        6_000_000, ge=1, description="cap on input bytes read (None: everything)"
    )
    shard_tokens: int = Field(1 << 22, ge=1024, description="tokens per Parquet shard")
    shuffle_window_shards: int = Field(8, ge=1, description="shards shuffled together per window")
    seed: int = 1337
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)

    @field_validator("cache_dir", "prepared")
    @classmethod
    def _storage_location(cls, value: str | None) -> str | None:
        return check_storage_location(value)

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0)
    min_lr: float = Field(1e-4, ge=0.0)
    warmup_steps: int = Field(50, ge=0)
    decay_steps: int | None = Field(
        None, ge=1, description="cosine decay length; max_steps if unset"
    )
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, ge=0.0, description="0 disables clipping")

    @model_validator(mode="after")
    def _min_below_peak(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must not exceed optim.lr ({self.lr})")
        return self


class TrainingConfig(_Section):
    global_batch_size: int = Field(
        32, ge=1, description="sequences per optimizer step, all workers"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per worker per forward pass; unset: no accumulation"
    )
    max_steps: int = Field(1000, ge=1)
    stop_after_step: int | None = Field(
        None, ge=1, description="end this invocation after this step; the run resumes later"
    )
    eval_every: int = Field(200, ge=1)
    eval_sequences: int | None = Field(256, ge=1, description="val sequences per eval (None: all)")
    log_every: int = Field(10, ge=1)
    seed: int = 1337
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on GPUs that have it, fp32 elsewhere"
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model; auto: on CUDA, off on CPU"
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward instead of keeping them: full (every "
        "block) or selective (keep matmul and attention outputs, recompute the cheap rest)",
    )
    sample_prompt: str = "def "
    sample_tokens: int = Field(200, ge=0)
    progress: bool = True
    ledger: bool = Field(False, description="record the global sequence indices each worker used")


class ParallelConfig(_Section):
    """How the model is spread over the workers (trainer/parallel.py; docs/parallelism.md)."""

    strategy: Literal["ddp", "fsdp", "auto"] = Field(
        "ddp",
        description="ddp: a whole copy per worker; fsdp: weights, gradients and optimizer state "
        "sharded over the workers; auto: fsdp when ddp's would not fit in one device",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free gathered weights after forward (gather again for backward)"
    )
    auto_state_fraction: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="auto: share of a device that weights + gradients + AdamW may take under ddp",
    )


BALANCE_AUTO_UNDER_FSDP = (
    "scaling.balance=auto times each rank's forward passes, which under FSDP wait on the "
    "other ranks' all-gathers; use parallel.strategy=ddp, or weights by type such as "
    "scaling.balance={A100: 3, L4: 1}"
)


class ScalingConfig(_Section):
    num_workers: int = Field(2, ge=1, description="workers for a fixed-size run")
    min_workers: int | None = Field(
        None, ge=1, description="elastic runs: the fewest workers to keep training with"
    )
    max_workers: int | None = Field(
        None, ge=1, description="elastic runs: the most workers to grow to (default num_workers)"
    )
    use_gpu: bool | Literal["auto"] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_worker: float = Field(1.0, gt=0.0, description="GPUs per worker when use_gpu")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources each worker needs"
    )
    data_cpus: float = Field(1.0, ge=0.0, description="CPUs kept free for Ray Data tasks")
    accelerator_type: str | list[str] | None = Field(
        None, description="GPU type(s) workers may use, e.g. A100 or [A100, H100]"
    )
    capacity: Literal["any", "spot", "on_demand"] = Field(
        "any", description="which nodes workers may use (nodes carry a spot or on_demand resource)"
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels workers require, e.g. {zone: us-a}"
    )
    allow_mixed_accelerators: bool = Field(
        False, description="let one run's DDP group span several accelerator types"
    )
    balance: Literal["none", "auto"] | dict[str, float] = Field(
        "none",
        description="shares of the global batch: none (equal), auto (by measured speed) or "
        "weights by accelerator type, e.g. {A100: 3, L4: 1, default: 1}",
    )
    balance_tolerance: float = Field(
        0.15,
        gt=0.0,
        description="balance: auto re-plans at a checkpoint when the slowest rank's forward "
        "time per step exceeds the mean by more than this fraction",
    )
    resize_check_s: float = Field(
        60.0, gt=0.0, description="elastic runs: how often to look for room to grow"
    )
    ray_address: str | None = Field(None, description="cluster to join; None: start a local Ray")

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_setting(cls, value: Any) -> Any:
        if not isinstance(value, dict) and value not in ("none", "auto"):
            raise ValueError(
                "scaling.balance must be none, auto or weights by accelerator type such as "
                "{A100: 3, L4: 1}"
            )
        if isinstance(value, dict):
            if not value:
                raise ValueError("scaling.balance: give weights by type, or none or auto")
            bad = {
                k: w
                for k, w in value.items()
                if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < math.inf
            }
            if bad:
                raise ValueError(f"scaling.balance weights must be positive numbers: {bad}")
            upper = [str(k).upper() for k in value]
            if len(set(upper)) < len(upper):
                raise ValueError(f"scaling.balance names a type twice (case aside): {list(value)}")
        return value

    @model_validator(mode="after")
    def _elastic_bounds(self) -> ScalingConfig:
        if self.min_size > self.max_size:
            raise ValueError(
                f"scaling.min_workers ({self.min_size}) exceeds the most workers allowed "
                f"({self.max_size}, from scaling.max_workers or scaling.num_workers)"
            )
        return self

    @property
    def max_size(self) -> int:
        return self.max_workers or self.num_workers

    @property
    def min_size(self) -> int:
        return self.min_workers or self.max_size

    @property
    def elastic(self) -> bool:
        return self.min_size < self.max_size

    @property
    def world_sizes(self) -> range:
        return range(self.min_size, self.max_size + 1)


class FaultConfig(_Section):
    max_failures: int = Field(
        3, ge=-1, description="restarts after worker/node failures (-1: unlimited)"
    )
    max_preemptions: int = Field(
        -1, ge=-1, description="restarts after spot preemptions, counted apart (-1: unlimited)"
    )
    worker_start_timeout_s: float = Field(
        600.0, gt=0.0, description="how long a worker group may take to start (GPU nodes boot)"
    )
    collective_timeout_s: float = Field(
        300.0, gt=0.0, description="a DDP collective waiting longer than this fails"
    )
    step_timeout_s: float = Field(
        900.0, gt=0.0, description="watchdog: a worker with no finished step for this long exits"
    )
    health_check_s: float = Field(2.0, gt=0.0, description="how often Ray Train polls workers")
    node_loss_wait_s: float = Field(
        10.0,
        ge=0.0,
        description="elastic runs: after a failure, wait this long for Ray to mark a lost node "
        "dead so the restart is sized for the nodes left (0: restart at once)",
    )
    preemption_check_s: float = Field(
        2.0, gt=0.0, description="how often the loop asks whether a node is being preempted"
    )
    stop_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="after a stop request (`raytrain-lm stop`, SIGTERM, Ctrl-C), how long the "
        "run may take to checkpoint at a step boundary before it is ended without one",
    )
    checkpoint_on_preemption: bool = Field(
        True, description="write a just-in-time checkpoint when a worker's node is drained"
    )
    price_per_hour: dict[str, float] = Field(
        default_factory=dict,
        description="price per worker-hour by accelerator type (or 'cpu'), for live cost",
    )


class CheckpointConfig(_Section):
    every_steps: int = Field(200, ge=1)
    keep_last: int = Field(2, ge=1)
    keep_best: bool = Field(True, description="also keep the checkpoint with the best val loss")
    upload_retry_s: float = Field(
        600.0,
        gt=0,
        description="how long a checkpoint upload is retried while its bucket is unreachable "
        "before the worker group fails (and restarts from the previous complete checkpoint)",
    )


# Where run state and prepared data may live besides a local folder (pyarrow.fs schemes).
STORAGE_SCHEMES = ("s3", "gs", "gcs", "file")


def check_storage_location(value: str | None) -> str | None:
    """A local path, or a URI of a scheme pyarrow can write to: never a URI folded into a
    local folder named `s3a:` that the user believes is a bucket."""
    if value is None or "://" not in value:
        return value
    scheme, _, rest = value.partition("://")
    if scheme not in STORAGE_SCHEMES:
        raise ValueError(
            f"{scheme}:// is not a storage this can write to; use a local path or "
            f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}"
        )
    if scheme != "file" and not rest.split("/", 1)[0]:
        raise ValueError("the URI names no bucket")
    return value


def _absolute_store_uri(uri: str, base_dir: str | Path) -> str:
    """`uri` with a relatively named local store (`sqlite:///mlflow.db`, `./mlruns`) made
    absolute against `base_dir`; servers and absolute paths are returned unchanged."""
    base = os.path.abspath(base_dir)
    if uri.startswith("sqlite:///"):
        path, sep, query = uri.removeprefix("sqlite:///").partition("?")
        if path and not path.startswith(("/", ":memory:")):
            return f"sqlite:///{os.path.normpath(os.path.join(base, path))}{sep}{query}"
    elif uri.startswith((".", "~")) or ("/" in uri and ":" not in uri):
        # a bare path: MLflow's file store (bare words such as `databricks` are not paths)
        return os.path.normpath(os.path.join(base, os.path.expanduser(uri)))
    return uri


class TrackingConfig(_Section):
    enabled: bool = True
    uri: str | None = Field(
        None, description="MLflow URI; else $MLFLOW_TRACKING_URI; else sqlite:///./mlflow.db"
    )
    experiment: str = "raytrain-lm"
    start_wait_s: float = Field(
        600.0,
        ge=0,
        description="how long a run (or a sweep's trial) waits for an unreachable tracking "
        "store before it starts; once running, an outage only buffers metrics",
    )

    def store_uri(self, base_dir: str | Path) -> str:
        """The store a run logs to: `uri`, else $MLFLOW_TRACKING_URI, else an sqlite file
        `mlflow.db`; a local file named relatively is taken relative to `base_dir`."""
        uri = self.uri or os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{DEFAULT_TRACKING_DB}"
        return _absolute_store_uri(uri, base_dir)


class RunConfig(_Section):
    name: str = Field("demo", pattern=RUN_NAME_PATTERN)
    output_dir: str = Field("runs", description="where runs go (a path or a bucket URI)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def resolved(self, base_dir: str | Path | None = None) -> RunConfig:
        """A copy in which every local path is absolute, taken relative to `base_dir` (default:
        the working directory), and `tracking.uri` names the store the run will use (see
        `TrackingConfig.store_uri`). URIs (`s3://...`) and `builtin:` corpora are kept as given.

        Ray Train workers, Tune trials and job drivers run in working directories of their own
        (under Ray's session folder): resolving once, on the driver, makes them all read and
        write the files the user named, and never consult the environment for the store."""
        from raytrain_lm.storage import is_uri  # pyarrow: too heavy for every import

        base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())

        def absolute(path: str) -> str:
            if path.startswith("file://"):
                path = path.removeprefix("file://")
            if is_uri(path) or path.startswith("builtin:"):
                return path
            return os.path.normpath(os.path.join(base, os.path.expanduser(path)))

        cfg = self.model_copy(deep=True)
        cfg.output_dir = absolute(cfg.output_dir)
        data = cfg.data
        data.sources = [absolute(source) for source in data.sources]
        data.cache_dir = absolute(data.cache_dir)
        if data.prepared:
            data.prepared = absolute(data.prepared)
        if data.tokenizer.path:
            data.tokenizer.path = absolute(data.tokenizer.path)
        if cfg.model.init_from:
            cfg.model.init_from = absolute(cfg.model.init_from)
        if cfg.tracking.enabled:
            cfg.tracking.uri = cfg.tracking.store_uri(base)
        return cfg

    @field_validator("output_dir")
    @classmethod
    def _output_location(cls, value: str) -> str:
        return check_storage_location(value)

    @model_validator(mode="after")
    def _batch_fits_workers(self) -> RunConfig:
        # The global batch never changes with the world size, so it must split evenly at
        # every size an elastic run may take: refuse up front, not at the first resize.
        # Balanced shares are uneven anyway: one sequence per rank is all they need.
        micro = self.training.micro_batch_size
        if self.scaling.balance != "none":
            if self.training.global_batch_size < self.scaling.max_size:
                raise ValueError(
                    f"training.global_batch_size ({self.training.global_batch_size}) gives "
                    f"fewer than one sequence to each of up to {self.scaling.max_size} workers"
                )
            if self.scaling.balance == "auto" and self.parallel.strategy == "fsdp":
                raise ValueError(BALANCE_AUTO_UNDER_FSDP)
            return self
        for world in self.scaling.world_sizes:
            unit = world * (micro or 1)
            if self.training.global_batch_size % unit:
                if self.scaling.elastic:
                    what = (
                        f"world size {world} (the run may use {self.scaling.min_size} to "
                        f"{self.scaling.max_size} workers)"
                    )
                else:
                    what = f"scaling.num_workers ({world})"
                if micro:
                    what += f" x training.micro_batch_size ({micro})"
                raise ValueError(
                    f"training.global_batch_size ({self.training.global_batch_size}) "
                    f"is not divisible by {what}"
                )
        return self


# ----------------------------------------------------------------------------- loading


def closest_key_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """Names the valid key nearest to an unknown one at `loc` (a pydantic error location)."""
    section: type[BaseModel] = model
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        section = annotation
    valid = list(section.model_fields)
    match = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.0)
    prefix = ".".join(str(p) for p in loc[:-1])
    if not match:
        return ""
    return f"; did you mean '{prefix + '.' if prefix else ''}{match[0]}'?"


def format_validation_error(
    err: ValidationError, origin: str, model: type[BaseModel] = RunConfig
) -> str:
    """The first problem in `err` (raised validating `model` from `origin`) as one line
    naming the key: an unknown key with the closest valid one, a missing key, or a bad value
    with what was given."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        return f"{origin}: unknown key '{key}'{closest_key_hint(model, loc)}"
    if first["type"] == "missing":
        return f"{origin}: missing '{key}'"
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return f"{origin}: {message}"
    return f"{origin}: invalid value for '{key}': {message} (got {first.get('input')!r})"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 0.0003). Values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise UserError(f"override '{text}' is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise UserError(f"override '{text}': cannot parse value: {exc}".splitlines()[0]) from None
    return key.split("."), fix_yaml_floats(value)


def set_dotted(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """tree[path[0]][path[1]]... = value, creating sections on the way."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override '{'.'.join(path)}': '{part}' is not a section")
        node = child
    node[path[-1]] = value


def fix_yaml_floats(node: Any) -> Any:
    """`node` with strings such as "3e-4" turned into floats (YAML 1.1 reads them as strings)."""
    if isinstance(node, dict):
        return {k: fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [fix_yaml_floats(v) for v in node]
    if isinstance(node, str) and re.fullmatch(r"[-+]?\d*\.?\d+[eE][-+]?\d+", node):
        return float(node)
    return node


def read_yaml_file(path: str | Path, what: str) -> Any:
    """The parsed YAML of `path`; a missing file or bad syntax is a one-line UserError."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{what} file not found: {path}")
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{path}: YAML syntax error{where}: {problem}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Builds the run config from an optional YAML file and `section.key=value` overrides.

    Raises `UserError` naming the offending key (and the closest valid one) on any problem.
    """
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        loaded = read_yaml_file(path, "config")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{path}: top level must be a mapping of sections")
        tree = fix_yaml_floats(loaded)
    for text in overrides or []:
        keys, value = parse_override(text)
        set_dotted(tree, keys, value)
        origin = f"{origin} + overrides" if "overrides" not in origin else origin
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise UserError(format_validation_error(err, origin)) from None


def flatten(cfg: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> scalar, for MLflow params."""
    tree = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_yaml(cfg: RunConfig) -> str:
    """`cfg` as YAML with its secrets hidden (`redaction`): every config a run writes down
    (its run directory, checkpoints, MLflow artifact) or prints goes through here. Readers of
    such a file (resume checks, `generate`) need no secret, and the file still validates."""
    return yaml.safe_dump(redact_tree(cfg.model_dump(mode="json")), sort_keys=False)
