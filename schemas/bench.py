"""Benchmark results: the JSON `specstore bench` writes and `specstore report` reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PromptRecord(BaseModel):
    """One method on one prompt (one turn)."""

    model_config = ConfigDict(frozen=True)

    method: str
    prompt_id: str
    category: str
    turn: int = 1
    num_tokens: int
    steps: int = Field(description="target forwards, prefill included")
    accepted_per_step: list[int]
    num_drafted: int
    num_accepted: int
    num_relaxed: int = 0
    wall_s: float
    drafting_s: float
    verifying_s: float
    retrieval_ms: list[float] = Field(default_factory=list, description="per-step drafting latency")
    identical_to_ar: bool | None = None
    first_diff: int | None = Field(None, description="first generated position differing from ar, if any")
    host_other_s: float | None = Field(
        None, description="CPU seconds other processes used during the run (runtime/bench/host.py; None: not measured)")
    host_steal_s: float | None = Field(None, description="seconds the hypervisor took the cores during the run (ditto)")
    prompt_ids: list[int] | None = Field(None, description="stored for ar only: the simulator's references")
    output_ids: list[int] | None = Field(None, description="stored for ar only")


class Summary(BaseModel):
    """Aggregates over a set of prompt records of one method."""

    model_config = ConfigDict(frozen=True)

    num_prompts: int
    num_tokens: int
    mat: float = Field(description="generated tokens per target forward, bonus token included")
    acceptance_rate: float = Field(description="accepted draft tokens / drafted tokens")
    tokens_per_s: float
    speedup_vs_ar: float | None = Field(description="ar wall time / this method's wall time on the same prompts")
    speedup_ci: tuple[float, float] | None = Field(
        None, description="bootstrap interval of speedup_vs_ar over prompts (paired, percentile; older files: absent)")
    speedup_ci_level: float | None = Field(None, description="its coverage, e.g. 0.95")
    drafting_share: float
    retrieval_ms_median: float | None = None
    accepted_length_histogram: dict[int, int] = Field(default_factory=dict, description="accepted draft tokens per decode step")
    identical_to_ar: bool | None = Field(None, description="true only if every output equals ar's")
    identical_share: float | None = None
    num_relaxed: int = 0


class MethodResult(Summary):
    lossless: bool
    per_category: dict[str, Summary] = Field(default_factory=dict)


class BenchResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    created_at: str
    command: str
    machine: dict[str, str | int | float | None]
    device: str
    dtype: str
    model: str
    datastore: str | None
    manifest_sha256: str | None
    torch_version: str
    transformers_version: str
    questions: str
    max_new_tokens: int
    temperature: float
    methods: dict[str, MethodResult]
    prompts: list[PromptRecord] = Field(default_factory=list)
    cost_model: dict | None = Field(None, description="the verification cost model the cost-aware drafters started from (runtime/cost.py)")
    cost_models: dict[str, dict] = Field(
        default_factory=dict,
        description="per cost-aware method (its label), its own copy of the cost model as it ended: each method's "
                    "online corrections learn from its own steps only (empty in results written before 2026-12-04)")
