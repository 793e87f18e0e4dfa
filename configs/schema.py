"""The typed config: one section per step, validated before any work starts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, lt=1)]
Dtype = Literal["float32", "bfloat16"]


class ModelConfig(_Section):
    """A Llama-style decoder: sizes, RoPE, norm, dtypes."""

    name: str
    vocab_size: PosInt
    emb_dim: PosInt
    num_layers: PosInt
    num_heads: PosInt
    num_kv_heads: PosInt
    head_dim: PosInt
    mlp_dim: PosInt
    rope_theta: PosFloat
    norm_eps: PosFloat
    tie_embeddings: bool
    max_seq_len: PosInt
    init_std: PosFloat
    dtype: Dtype
    param_dtype: Dtype
    family: Literal["llama", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "mixtral", "qwen3_moe", "gpt_oss", "gemma4"]
    activation: Literal["silu", "gelu_tanh", "silu_clamped"]
    activation_limit: PosFloat
    norm_plus_one: bool
    scale_embeddings: bool
    qk_norm: bool
    v_norm: bool
    attention_bias: bool
    attention_sinks: bool
    global_head_dim: NonNegInt
    global_num_kv_heads: NonNegInt
    global_k_eq_v: bool
    post_norms: bool
    layer_scalar: bool
    query_pre_attn_scalar: NonNegFloat
    attn_softcap: NonNegFloat
    final_softcap: NonNegFloat
    sliding_window: NonNegInt
    global_every: NonNegInt
    rope_local_theta: NonNegFloat
    rope_scaling: Literal["none", "linear", "llama3", "yarn", "proportional"]
    rope_factor: PosFloat
    rope_low_freq_factor: PosFloat
    rope_high_freq_factor: PosFloat
    rope_original_max_len: PosInt
    rope_beta_fast: PosFloat
    rope_beta_slow: PosFloat
    rope_truncate: bool
    rope_attention_factor: NonNegFloat
    rope_fraction: Annotated[float, Field(gt=0, le=1)]
    attention: Literal["auto", "xla", "cudnn", "splash"]
    num_experts: NonNegInt
    experts_per_token: PosInt
    expert_mlp_dim: NonNegInt
    router_renormalize: bool
    router: Literal["softmax", "gemma4"]
    router_bias: bool
    expert_bias: bool
    moe_dense_mlp: bool
    load_balance_weight: NonNegFloat
    capacity_factor: NonNegFloat
    expert_buffer_factor: NonNegFloat
    moe_every: PosInt

    @property
    def moe(self) -> bool:
        """Whether the MLPs are Mixtures of Experts."""
        return self.num_experts > 0

    @property
    def expert_width(self) -> int:
        """Hidden width of one expert's MLP."""
        return self.expert_mlp_dim or self.mlp_dim

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 or self.global_head_dim % 2:
            raise ValueError(f"model.head_dim ({self.head_dim}) and model.global_head_dim ({self.global_head_dim}) "
                             "must be even for RoPE")
        if self.global_num_kv_heads and self.num_heads % self.global_num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of model.global_num_kv_heads "
                             f"({self.global_num_kv_heads})")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor for llama3 RoPE scaling")
        if self.moe and self.experts_per_token > self.num_experts:
            raise ValueError(f"model.experts_per_token ({self.experts_per_token}) exceeds model.num_experts ({self.num_experts})")
        if self.moe and self.num_layers % self.moe_every:
            raise ValueError(f"model.moe_every ({self.moe_every}) must divide model.num_layers ({self.num_layers})")
        return self


class DataConfig(_Section):
    """Beam prep: inputs, tokenizer, packing and split."""

    input: list[str]
    weights: list[PosFloat]
    text_field: str
    max_document_bytes: PosInt
    max_bad_fraction: Annotated[float, Field(ge=0, le=1)]
    dedup: bool
    packing: Literal["concat", "documents"]
    tokenizer: str
    seq_len: Annotated[int, Field(gt=1)]
    val_fraction: Annotated[float, Field(gt=0, lt=1)]
    train_shards: PosInt
    val_shards: PosInt
    bpe_train_max_bytes: PosInt
    beam_args: list[str]

    @model_validator(mode="after")
    def _one_weight_per_input(self) -> "DataConfig":
        if self.weights and len(self.weights) != len(self.input):
            raise ValueError(f"data.weights has {len(self.weights)} values for {len(self.input)} data.input globs: give one per glob, or none")
        return self


class ProfileConfig(_Section):
    """Which steps a JAX profiler trace records: `steps` steps from step `start` (steps 0 = off)."""

    start: PosInt
    steps: NonNegInt


class TrainSettings(_Section):
    """How a training is checkpointed and watched: these do not change its result, so they do not version it."""

    checkpoint_every: PosInt
    keep_checkpoints: PosInt
    log_every: PosInt
    tensorboard: bool
    eval_every: NonNegInt
    eval_batches: PosInt
    profile: ProfileConfig
    hlo_dump: bool
    slow_step_factor: NonNegFloat
    hang_dump_seconds: NonNegFloat
    hang_exit_seconds: NonNegFloat


class TrainConfig(TrainSettings):
    """Optimizer, schedule and mesh for the train step, and its run settings (TrainSettings)."""

    steps: PosInt
    batch_size: PosInt
    learning_rate: PosFloat
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)]
    warmup_steps: NonNegInt
    weight_decay: NonNegFloat
    b1: Fraction
    b2: Fraction
    grad_clip: NonNegFloat
    seed: int
    mesh: dict[Literal["data", "fsdp", "expert", "context", "tensor"], int]
    dcn_mesh: dict[Literal["data", "fsdp", "expert", "context", "tensor"], int]
    remat: Literal["none", "minimal", "full", "custom"]
    remat_save: list[str]
    remat_offload: list[str]
    vocab_tiling: PosInt
    optimizer_offload: bool
    grad_accum_steps: PosInt
    quantization: Literal["none", "int8", "fp8"]
    continue_from: Literal["", "latest_export"]

    @model_validator(mode="after")
    def _schedule_fits(self) -> "TrainConfig":
        if self.warmup_steps >= self.steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be below train.steps ({self.steps})")
        for name, axes in (("train.mesh", self.mesh), ("train.dcn_mesh", self.dcn_mesh)):
            if list(axes.values()).count(-1) > 1:
                # `train.mesh.fsdp=-1` changes one axis of the base mesh, whose data axis is -1 already.
                raise ValueError(f"{name} {axes}: at most one axis may be -1 (fill the remaining devices); "
                                 f"{name}='{{fsdp: -1}}' sets the whole mesh (axes left out are 1)")
            if any(v == 0 or v < -1 for v in axes.values()):
                raise ValueError(f"{name}: axis sizes must be positive or -1")
        return self


class ExportConfig(_Section):
    """What the export step writes: dtype and layout of the param-only checkpoint, HF shard size."""

    dtype: Literal["", "float32", "bfloat16"]
    unscanned: bool
    max_shard_bytes: PosInt


class EvalConfig(_Section):
    """Validation perplexity and generation."""

    batch_size: PosInt
    max_batches: NonNegInt
    prompt: str
    max_new_tokens: NonNegInt
    temperature: NonNegFloat
    top_k: NonNegInt
    top_p: Annotated[float, Field(gt=0, le=1)]
    seed: int
    tasks: list[str]


class PipelineConfig(_Section):
    """Where runs write (pipeline root, artifact store), and an optional HF checkpoint to start from."""

    name: str
    root: str
    store: str
    hf_checkpoint: str
    hf_allow_pickle: bool
    lease_timeout: PosFloat


class StepResources(_Section):
    """What one step asks of Vertex AI / Kubeflow (ignored by local runs)."""

    image: str  # a key of resources.images, or a full image URI
    cpu: str
    memory: str
    accelerator_type: str  # e.g. NVIDIA_H100_80GB, TPU_V5_LITEPOD; "" = none
    accelerator_count: NonNegInt

    @model_validator(mode="after")
    def _accelerator_pairs(self) -> "StepResources":
        if bool(self.accelerator_type) != bool(self.accelerator_count):
            raise ValueError("accelerator_type and accelerator_count must be set together")
        return self


class TrainResources(StepResources):
    """The train step's resources; several machines (or a TPU slice) make it a Vertex AI custom job."""

    replicas: PosInt  # machines (multi-host training); each gets accelerator_count accelerators
    machine_type: str  # Vertex AI machine type for the custom job, e.g. a3-highgpu-8g, ct5lp-hightpu-4t
    tpu_topology: str  # a TPU slice's topology, e.g. 4x4; "" = not a TPU slice

    @property
    def custom_job(self) -> bool:
        """Whether training runs as a (multi-host) Vertex AI custom job rather than inside its pipeline task."""
        return self.replicas > 1 or bool(self.tpu_topology)

    @model_validator(mode="after")
    def _job_needs_machine(self) -> "TrainResources":
        if self.custom_job and not self.machine_type:
            raise ValueError("resources.train.machine_type is needed for multi-host training (replicas > 1 or tpu_topology)")
        return self


class ResourcesConfig(_Section):
    """Images and per-step resources for the compiled pipeline."""

    images: dict[str, str]
    prep: StepResources
    ingest: StepResources
    train: TrainResources
    export: StepResources
    eval: StepResources

    def image(self, step: str) -> str:
        """The container image of a step."""
        name = getattr(self, step).image
        return self.images.get(name, name)


class Config(_Section):
    """The whole resolved config."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    export: ExportConfig
    eval: EvalConfig
    pipeline: PipelineConfig
    resources: ResourcesConfig

    @model_validator(mode="after")
    def _fits_together(self) -> "Config":
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        return self
