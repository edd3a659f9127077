# Post-processed by scripts/gen_proto.py: regenerate, do not edit.
import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "n", "logit_bias", "regex", "json_schema", "ebnf_grammar", "structural_tag", "no_stop_trim", "custom_params", "sampling_seed")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    EBNF_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    logit_bias: _containers.ScalarMap[str, float]
    regex: str
    json_schema: str
    ebnf_grammar: str
    structural_tag: str
    no_stop_trim: bool
    custom_params: _struct_pb2.Struct
    sampling_seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[str, float]] = ..., regex: _Optional[str] = ..., json_schema: _Optional[str] = ..., ebnf_grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ..., no_stop_trim: _Optional[bool] = ..., custom_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., sampling_seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tokenized", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "stream", "mm_inputs", "encode_bootstrap_info", "kv_bootstrap_info", "data_parallel_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_BOOTSTRAP_INFO_FIELD_NUMBER: _ClassVar[int]
    KV_BOOTSTRAP_INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokenized: TokenizedInput
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    stream: bool
    mm_inputs: MultimodalInputs
    encode_bootstrap_info: EncodeBootstrapInfo
    kv_bootstrap_info: KvBootstrapInfo
    data_parallel_rank: int
    def __init__(self, request_id: _Optional[str] = ..., tokenized: _Optional[_Union[TokenizedInput, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., logprob_start_len: _Optional[int] = ..., top_logprobs_num: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., stream: _Optional[bool] = ..., mm_inputs: _Optional[_Union[MultimodalInputs, _Mapping]] = ..., encode_bootstrap_info: _Optional[_Union[EncodeBootstrapInfo, _Mapping]] = ..., kv_bootstrap_info: _Optional[_Union[KvBootstrapInfo, _Mapping]] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class EncodeBootstrapInfo(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodeItemBootstrapInfo]
    def __init__(self, items: _Optional[_Iterable[_Union[EncodeItemBootstrapInfo, _Mapping]]] = ...) -> None: ...

class EncodeItemBootstrapInfo(_message.Message):
    __slots__ = ("item_index", "bootstrap_host", "bootstrap_port", "bootstrap_room")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_HOST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    def __init__(self, item_index: _Optional[int] = ..., bootstrap_host: _Optional[str] = ..., bootstrap_port: _Optional[int] = ..., bootstrap_room: _Optional[int] = ...) -> None: ...

class KvBootstrapInfo(_message.Message):
    __slots__ = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    BOOTSTRAP_HOST_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    def __init__(self, bootstrap_host: _Optional[str] = ..., bootstrap_port: _Optional[int] = ..., bootstrap_room: _Optional[int] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("input_ids", "original_text")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    original_text: str
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., original_text: _Optional[str] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("shape", "dtype", "inline", "shm", "remote")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    inline: bytes
    shm: _common_pb2.ShmHandle
    remote: _common_pb2.RemoteTensorHandle
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., inline: _Optional[bytes] = ..., shm: _Optional[_Union[_common_pb2.ShmHandle, _Mapping]] = ..., remote: _Optional[_Union[_common_pb2.RemoteTensorHandle, _Mapping]] = ...) -> None: ...

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MultimodalItem(_message.Message):
    __slots__ = ("modality", "content_hash", "encoder_input", "model_specific_tensors", "placeholders", "placeholder_token_id")
    class ModelSpecificTensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPECIFIC_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    modality: _common_pb2.Modality
    content_hash: bytes
    encoder_input: TensorData
    model_specific_tensors: _containers.MessageMap[str, TensorData]
    placeholders: _containers.RepeatedCompositeFieldContainer[PlaceholderRange]
    placeholder_token_id: int
    def __init__(self, modality: _Optional[_Union[_common_pb2.Modality, str]] = ..., content_hash: _Optional[bytes] = ..., encoder_input: _Optional[_Union[TensorData, _Mapping]] = ..., model_specific_tensors: _Optional[_Mapping[str, TensorData]] = ..., placeholders: _Optional[_Iterable[_Union[PlaceholderRange, _Mapping]]] = ..., placeholder_token_id: _Optional[int] = ...) -> None: ...

class MultimodalInputs(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MultimodalItem]
    def __init__(self, items: _Optional[_Iterable[_Union[MultimodalItem, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateStreamChunk
    complete: GenerateComplete
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateStreamChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ...) -> None: ...

class GenerateStreamChunk(_message.Message):
    __slots__ = ("token_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "output_logprobs", "index", "weight_version")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: OutputLogProbs
    index: int
    weight_version: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Union[OutputLogProbs, _Mapping]] = ..., index: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("output_ids", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "output_logprobs", "matched_token_id", "matched_stop_str", "index", "spec_accepted_tokens", "spec_draft_tokens", "weight_version")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: OutputLogProbs
    matched_token_id: int
    matched_stop_str: str
    index: int
    spec_accepted_tokens: int
    spec_draft_tokens: int
    weight_version: str
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_logprobs: _Optional[_Union[OutputLogProbs, _Mapping]] = ..., matched_token_id: _Optional[int] = ..., matched_stop_str: _Optional[str] = ..., index: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class OutputLogProbs(_message.Message):
    __slots__ = ("token_logprobs", "token_ids", "top_logprobs")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogProbs]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogProbs, _Mapping]]] = ...) -> None: ...

class TopLogProbs(_message.Message):
    __slots__ = ("values", "token_ids")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("healthy", "message")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    message: str
    def __init__(self, healthy: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_path", "tokenizer_path", "served_model_name", "model_type", "architectures", "max_context_length", "max_req_input_len", "vocab_size", "eos_token_ids", "pad_token_id", "bos_token_id", "weight_version", "default_sampling_params_json", "supports_vision", "supports_multimodal", "supported_modalities", "model_dtype", "multimodal_encoder_dtype")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_REQ_INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_VISION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_ENCODER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    tokenizer_path: str
    served_model_name: str
    model_type: str
    architectures: _containers.RepeatedScalarFieldContainer[str]
    max_context_length: int
    max_req_input_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    bos_token_id: int
    weight_version: str
    default_sampling_params_json: str
    supports_vision: bool
    supports_multimodal: bool
    supported_modalities: _containers.RepeatedScalarFieldContainer[_common_pb2.Modality]
    model_dtype: str
    multimodal_encoder_dtype: str
    def __init__(self, model_path: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., served_model_name: _Optional[str] = ..., model_type: _Optional[str] = ..., architectures: _Optional[_Iterable[str]] = ..., max_context_length: _Optional[int] = ..., max_req_input_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., weight_version: _Optional[str] = ..., default_sampling_params_json: _Optional[str] = ..., supports_vision: _Optional[bool] = ..., supports_multimodal: _Optional[bool] = ..., supported_modalities: _Optional[_Iterable[_Union[_common_pb2.Modality, str]]] = ..., model_dtype: _Optional[str] = ..., multimodal_encoder_dtype: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("server_args", "scheduler_info", "active_requests", "is_paused", "uptime_seconds", "max_total_num_tokens", "tokenspeed_version", "start_time", "constrained_decoding")
    SERVER_ARGS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INFO_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENSPEED_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_DECODING_FIELD_NUMBER: _ClassVar[int]
    server_args: _struct_pb2.Struct
    scheduler_info: _struct_pb2.Struct
    active_requests: int
    is_paused: bool
    uptime_seconds: float
    max_total_num_tokens: int
    tokenspeed_version: str
    start_time: _timestamp_pb2.Timestamp
    constrained_decoding: str
    def __init__(self, server_args: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., scheduler_info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., active_requests: _Optional[int] = ..., is_paused: _Optional[bool] = ..., uptime_seconds: _Optional[float] = ..., max_total_num_tokens: _Optional[int] = ..., tokenspeed_version: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., constrained_decoding: _Optional[str] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ("dp_rank", "include")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    include: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dp_rank: _Optional[int] = ..., include: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadsResponse(_message.Message):
    __slots__ = ("timestamp", "version", "dp_rank_count", "loads", "aggregate")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    timestamp: str
    version: str
    dp_rank_count: int
    loads: _containers.RepeatedCompositeFieldContainer[SchedulerLoad]
    aggregate: AggregateMetrics
    def __init__(self, timestamp: _Optional[str] = ..., version: _Optional[str] = ..., dp_rank_count: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[SchedulerLoad, _Mapping]]] = ..., aggregate: _Optional[_Union[AggregateMetrics, _Mapping]] = ...) -> None: ...

class SchedulerLoad(_message.Message):
    __slots__ = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "max_running_requests", "num_waiting_uncached_tokens", "token_usage", "active_token_usage", "gen_throughput", "cache_hit_rate", "utilization", "memory", "queues")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    num_waiting_uncached_tokens: int
    token_usage: float
    active_token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    utilization: float
    memory: MemoryMetrics
    queues: QueueMetrics
    def __init__(self, dp_rank: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_total_reqs: _Optional[int] = ..., num_used_tokens: _Optional[int] = ..., max_total_num_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., num_waiting_uncached_tokens: _Optional[int] = ..., token_usage: _Optional[float] = ..., active_token_usage: _Optional[float] = ..., gen_throughput: _Optional[float] = ..., cache_hit_rate: _Optional[float] = ..., utilization: _Optional[float] = ..., memory: _Optional[_Union[MemoryMetrics, _Mapping]] = ..., queues: _Optional[_Union[QueueMetrics, _Mapping]] = ...) -> None: ...

class MemoryMetrics(_message.Message):
    __slots__ = ("weight_gb", "kv_cache_gb", "graph_gb", "token_capacity")
    WEIGHT_GB_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GB_FIELD_NUMBER: _ClassVar[int]
    GRAPH_GB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    token_capacity: int
    def __init__(self, weight_gb: _Optional[float] = ..., kv_cache_gb: _Optional[float] = ..., graph_gb: _Optional[float] = ..., token_capacity: _Optional[int] = ...) -> None: ...

class QueueMetrics(_message.Message):
    __slots__ = ("waiting", "grammar", "paused", "retracted")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RETRACTED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    grammar: int
    paused: int
    retracted: int
    def __init__(self, waiting: _Optional[int] = ..., grammar: _Optional[int] = ..., paused: _Optional[int] = ..., retracted: _Optional[int] = ...) -> None: ...

class AggregateMetrics(_message.Message):
    __slots__ = ("total_running_reqs", "total_waiting_reqs", "total_reqs", "avg_token_usage", "avg_throughput", "avg_utilization")
    TOTAL_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQS_FIELD_NUMBER: _ClassVar[int]
    AVG_TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    AVG_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    AVG_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    total_running_reqs: int
    total_waiting_reqs: int
    total_reqs: int
    avg_token_usage: float
    avg_throughput: float
    avg_utilization: float
    def __init__(self, total_running_reqs: _Optional[int] = ..., total_waiting_reqs: _Optional[int] = ..., total_reqs: _Optional[int] = ..., avg_token_usage: _Optional[float] = ..., avg_throughput: _Optional[float] = ..., avg_utilization: _Optional[float] = ...) -> None: ...
