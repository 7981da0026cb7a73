from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DenseProbs(_message.Message):
    __slots__ = ("probs", "fp16")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    FP16_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    fp16: bytes
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., fp16: _Optional[bytes] = ...) -> None: ...

class OneHot(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FixedProbs(_message.Message):
    __slots__ = ("id_gaps", "weights")
    ID_GAPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    id_gaps: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id_gaps: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "kind", "vocab_size", "vocab_fingerprint", "max_context", "eos_token_ids", "device", "dtype", "max_k", "sessions_held", "cache_bytes", "cache_evictions", "min_ngram", "max_ngram", "default_k", "weights_fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_HELD_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_K_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    max_k: int
    sessions_held: int
    cache_bytes: int
    cache_evictions: int
    min_ngram: int
    max_ngram: int
    default_k: int
    weights_fingerprint: str
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_k: _Optional[int] = ..., sessions_held: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ..., default_k: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "keep_for_reuse")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FOR_REUSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_for_reuse: bool
    def __init__(self, session_id: _Optional[str] = ..., keep_for_reuse: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("num_speculative_tokens", "disabled", "pipeline", "adaptive")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    disabled: bool
    pipeline: bool
    adaptive: bool
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., disabled: _Optional[bool] = ..., pipeline: _Optional[bool] = ..., adaptive: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "stop", "speculation", "session_id", "ignore_eos", "messages", "affinity_key")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_KEY_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationParams
    session_id: str
    ignore_eos: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    affinity_key: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., session_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., affinity_key: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session_id", "received_tokens", "received_chars")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_CHARS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    received_tokens: int
    received_chars: int
    def __init__(self, session_id: _Optional[str] = ..., received_tokens: _Optional[int] = ..., received_chars: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class CycleInfo(_message.Message):
    __slots__ = ("index", "drafted", "accepted", "bonus", "draft_ms", "verify_ms", "k", "draft_bytes", "pipelined", "forward_ms", "commit_ms", "looked_up")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    index: int
    drafted: int
    accepted: int
    bonus: bool
    draft_ms: float
    verify_ms: float
    k: int
    draft_bytes: int
    pipelined: bool
    forward_ms: float
    commit_ms: float
    looked_up: bool
    def __init__(self, index: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus: _Optional[bool] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., k: _Optional[int] = ..., draft_bytes: _Optional[int] = ..., pipelined: _Optional[bool] = ..., forward_ms: _Optional[float] = ..., commit_ms: _Optional[float] = ..., looked_up: _Optional[bool] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("cycles", "draft_tokens", "accepted_tokens", "accepted_per_position", "prompt_tokens", "generated_tokens", "elapsed_s", "first_token_s", "draft_cycles")
    CYCLES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CYCLES_FIELD_NUMBER: _ClassVar[int]
    cycles: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    generated_tokens: int
    elapsed_s: float
    first_token_s: float
    draft_cycles: int
    def __init__(self, cycles: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., draft_cycles: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "cycle", "session_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: GenerateStats
    cycle: CycleInfo
    session_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., cycle: _Optional[_Union[CycleInfo, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("target", "draft", "default_num_speculative_tokens", "max_new_tokens_limit")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    target: ModelInfoResponse
    draft: ModelInfoResponse
    default_num_speculative_tokens: int
    max_new_tokens_limit: int
    def __init__(self, target: _Optional[_Union[ModelInfoResponse, _Mapping]] = ..., draft: _Optional[_Union[ModelInfoResponse, _Mapping]] = ..., default_num_speculative_tokens: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "position", "new_tokens", "k", "sampling", "cycle", "vocab_fingerprint", "awaits_commit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AWAITS_COMMIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: SamplingParams
    cycle: int
    vocab_fingerprint: str
    awaits_commit: bool
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cycle: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., awaits_commit: _Optional[bool] = ...) -> None: ...

class DraftToken(_message.Message):
    __slots__ = ("token_id", "sparse", "dense", "one_hot", "fixed", "fixed_deflated", "index", "match_length")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ONE_HOT_FIELD_NUMBER: _ClassVar[int]
    FIXED_FIELD_NUMBER: _ClassVar[int]
    FIXED_DEFLATED_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    sparse: SparseProbs
    dense: DenseProbs
    one_hot: OneHot
    fixed: FixedProbs
    fixed_deflated: bytes
    index: int
    match_length: int
    def __init__(self, token_id: _Optional[int] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ..., dense: _Optional[_Union[DenseProbs, _Mapping]] = ..., one_hot: _Optional[_Union[OneHot, _Mapping]] = ..., fixed: _Optional[_Union[FixedProbs, _Mapping]] = ..., fixed_deflated: _Optional[bytes] = ..., index: _Optional[int] = ..., match_length: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "position", "new_tokens", "drafts", "sampling", "cycle", "draft_fingerprint", "draft_model", "steps", "draft_busy", "stop_at_ngram", "awaits_commit", "target_model", "target_fingerprint", "target_weights")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUSY_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_NGRAM_FIELD_NUMBER: _ClassVar[int]
    AWAITS_COMMIT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftToken]
    sampling: SamplingParams
    cycle: int
    draft_fingerprint: str
    draft_model: str
    steps: int
    draft_busy: bool
    stop_at_ngram: NgramStop
    awaits_commit: bool
    target_model: str
    target_fingerprint: str
    target_weights: str
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[_Union[DraftToken, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cycle: _Optional[int] = ..., draft_fingerprint: _Optional[str] = ..., draft_model: _Optional[str] = ..., steps: _Optional[int] = ..., draft_busy: _Optional[bool] = ..., stop_at_ngram: _Optional[_Union[NgramStop, _Mapping]] = ..., awaits_commit: _Optional[bool] = ..., target_model: _Optional[str] = ..., target_fingerprint: _Optional[str] = ..., target_weights: _Optional[str] = ...) -> None: ...

class NgramStop(_message.Message):
    __slots__ = ("min_ngram", "max_ngram")
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    min_ngram: int
    max_ngram: int
    def __init__(self, min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token", "bonus", "forward_ms", "accept_ms", "more_tokens")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_MS_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    bonus: bool
    forward_ms: float
    accept_ms: float
    more_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., bonus: _Optional[bool] = ..., forward_ms: _Optional[float] = ..., accept_ms: _Optional[float] = ..., more_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
