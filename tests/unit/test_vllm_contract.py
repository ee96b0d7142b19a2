"""Contract tests: every vLLM name, argument and config object that actors/vllm_engine.py and
common/vllm_weights.py use exists in the installed vLLM, with the meaning we rely on, and `vllm_api()`'s feature
detection reads the installed version right. Two API shapes are supported (0.26 and 0.33; the differences are in
`vllm_api`'s docstring): where they differ, a test checks the shape this vLLM has and that the engine layer
chose the matching path. No GPU needed: they construct configs and inspect signatures (`make test-gpu-contract`
runs them against vLLM 0.26.0 and 0.33.0). Skipped when vllm is not importable (the CPU environment)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not importable here (CPU env); run `make test-gpu-contract`")

from actors import vllm_engine  # noqa: E402
from common import vllm_weights  # noqa: E402
from common import weights  # noqa: E402
from common.messages import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def test_async_llm_has_the_methods_we_call_with_our_arguments():
    from vllm.v1.engine.async_llm import AsyncLLM

    assert vllm_engine.vllm_api().AsyncLLM is AsyncLLM
    assert inspect.isasyncgenfunction(AsyncLLM.generate)
    assert {"prompt", "sampling_params", "request_id"} <= set(_params(AsyncLLM.generate))
    pause = _params(AsyncLLM.pause_generation)
    assert pause["mode"].kind is inspect.Parameter.KEYWORD_ONLY and "clear_cache" in pause
    assert {"method", "timeout", "args", "kwargs"} <= set(_params(AsyncLLM.collective_rpc))
    assert "request" in _params(AsyncLLM.init_weight_transfer_engine)
    assert "request" in _params(AsyncLLM.update_weights)
    assert set(_params(AsyncLLM.start_weight_update)) == {"self"}  # no arguments in 0.26 and 0.33
    api = vllm_engine.vllm_api()
    awaited = ["pause_generation", "resume_generation", "collective_rpc", "init_weight_transfer_engine",
               "start_weight_update", "update_weights", "finish_weight_update"]
    if api.engine_versions:  # 0.33: the engine labels versions
        assert "weight_version" in _params(AsyncLLM.finish_weight_update)
        assert "new_version" in _params(AsyncLLM.update_weight_version)
        awaited.append("update_weight_version")
    else:  # 0.26: no label anywhere; VllmEngine calls finish_weight_update() bare and keeps the label itself
        assert set(_params(AsyncLLM.finish_weight_update)) == {"self"}
        assert not hasattr(AsyncLLM, "update_weight_version")
    for name in awaited:
        assert inspect.iscoroutinefunction(getattr(AsyncLLM, name)), f"AsyncLLM.{name} is awaited by VllmEngine"
    assert "engine_args" in _params(AsyncLLM.from_engine_args) and callable(AsyncLLM.shutdown)
    assert api.native_nccl


def test_pause_modes_we_map_to_exist():
    from vllm.v1.engine import PauseMode

    assert set(vllm_engine.PAUSE_MODE.values()) <= set(typing.get_args(PauseMode))


def test_engine_args_accept_ours_and_logprobs_mode_means_what_we_need(tiny_model_dir):
    from vllm.config import WeightTransferConfig
    from vllm.config.model import LogprobsMode

    kw = vllm_engine.engine_kwargs(tiny_model_dir, vllm_engine.VllmSettings(transport="nccl", max_model_len=512), 2, native_nccl=True)
    kw["weight_transfer_config"] = WeightTransferConfig(**kw["weight_transfer_config"])
    args = vllm.AsyncEngineArgs(**kw)
    assert args.logprobs_mode == "processed_logprobs" and args.tensor_parallel_size == 2
    assert args.weight_transfer_config.backend == "nccl" and args.worker_extension_cls == vllm_engine.EXTENSION
    assert "processed_logprobs" in typing.get_args(LogprobsMode)
    # vLLM's default is before temperature: the reason engine_kwargs sets the mode explicitly.
    assert vllm.AsyncEngineArgs(model=tiny_model_dir).logprobs_mode == "raw_logprobs"
    assert "backend" in {f.name for f in dataclasses.fields(WeightTransferConfig)}


def test_sampling_params_accept_ours():
    from vllm.sampling_params import RequestOutputKind

    kw = vllm_engine.sampling_kwargs(8, SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=64), 2**31 - 1, [0, 5], seeded=True)
    sp = vllm.SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
    assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.logprobs, sp.seed) == (8, 0.7, 0.95, 64, 0, kw["seed"])
    assert sp.stop_token_ids == [0, 5] and sp.detokenize is False and sp.flat_logprobs is True
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    greedy = vllm.SamplingParams(**vllm_engine.sampling_kwargs(1, SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=8), 0, [0]))
    assert greedy.temperature == 0.0 and greedy.seed is None  # seeded=False: no seed field


def test_child_requests_get_seed_plus_index():
    """request_seed leaves MAX_N seeds per prompt because vLLM seeds child j of a request with seed + j."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    parent = ParentRequest.__new__(ParentRequest)
    parent.sampling_params = vllm.SamplingParams(n=4, seed=vllm_engine.request_seed(3))
    parent.cached_child_sampling_params = None
    assert [parent._get_child_sampling_params(j).seed for j in range(4)] == [vllm_engine.request_seed(3) + j for j in range(4)]


def test_outputs_carry_tokens_logprobs_and_weight_version_spans():
    import vllm.outputs
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    fields = {f.name for f in dataclasses.fields(CompletionOutput)}
    assert {"index", "token_ids", "logprobs", "finish_reason"} <= fields
    assert vllm_engine.vllm_api().version_spans == ("weight_versions" in fields)
    assert {"outputs", "finished"} <= set(_params(RequestOutput.__init__))
    flat = FlatLogprobs()
    for tok, lp in ((7, -0.25), (3, -2.0)):
        flat.append({tok: Logprob(logprob=lp, rank=1)})
    assert vllm_engine.sampled_logprobs([7, 3], flat).tolist() == [-0.25, -2.0]
    kw = dict(index=0, text="", token_ids=[7, 3], cumulative_logprob=-2.25, logprobs=flat, finish_reason="stop")
    if "weight_versions" not in fields:  # 0.26: no labels; the engine's version at submission (finish mode, drained)
        assert not hasattr(vllm.outputs, "WeightVersionSpan")
        assert vllm_engine.to_completion(CompletionOutput(**kw), 4).versions.tolist() == [4, 4]
        with pytest.raises(RuntimeError, match="no per-token weight versions"):
            vllm_engine.to_completion(CompletionOutput(**kw), None)
        return
    Span = vllm.outputs.WeightVersionSpan
    spans = [Span("0", 0, 2), Span("1", 2, 3)]
    assert vllm_engine.versions_from_spans(spans, 3).tolist() == [0, 0, 1]
    out = CompletionOutput(**kw, weight_versions=spans[:1] + [Span("0", 2, 2)])
    assert vllm_engine.to_completion(out, None).versions.tolist() == [0, 0]


def test_paused_rejections_are_the_retryable_error_generate_raises():
    import vllm.exceptions

    retryable = getattr(vllm.exceptions, "RetryableRequestError", None)
    if retryable is None:  # 0.26: a paused engine queues new requests; nothing to retry
        assert vllm_engine.vllm_api().Retryable is vllm_engine.NeverRaised
    else:
        assert vllm_engine.vllm_api().Retryable is retryable and issubclass(retryable, vllm.exceptions.GenerationError)
    from vllm import TokensPrompt

    assert "prompt_token_ids" in typing.get_type_hints(TokensPrompt)  # we pass {"prompt_token_ids": [...]}


def test_weight_transfer_requests_and_nccl_infos_accept_ours():
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    fields = vllm_engine.vllm_api().nccl_fields
    assert fields == vllm_engine.nccl_info_fields(NCCLWeightTransferEngine)
    # covrl's one-broadcast-per-parameter protocol (packed=False) lands in whichever info this vLLM reads it from
    assert "packed" in fields[0] or "packed" in fields[1]
    init = vllm_engine.nccl_init_info(dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=3), fields)
    assert WeightTransferInitRequest(init_info=init).init_info == init
    info = NCCLWeightTransferEngine.init_info_cls(**init)
    assert (info.rank_offset, info.world_size) == (1, 3)
    lay = weights.Layout(("model.norm.weight", "lm_head.weight"), ((8,), (16, 8)))
    meta = vllm_engine.nccl_update_info(vllm_weights.bucket_meta(lay, 0, 2, torch.bfloat16), fields)
    upd = NCCLWeightTransferEngine.update_info_cls(**meta)
    assert upd.names == ["model.norm.weight", "lm_head.weight"] and upd.dtype_names == ["bfloat16"] * 2
    assert getattr(torch, upd.dtype_names[0]) is torch.bfloat16  # how the receiver reads the dtype
    assert (info if "packed" in fields[0] else upd).packed is False
    assert WeightTransferUpdateRequest(update_info=meta).update_info == meta


def test_trainer_and_extension_nccl_helpers_exist():
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    first, *rest = _params(trainer_init).values()  # learner/nccl.py calls trainer_init(init_info) only
    assert first.name == "init_info" and all(p.default is not inspect.Parameter.empty for p in rest)
    assert {"group", "device"} <= set(_params(PyNcclCommunicator.__init__))
    assert {"tensor", "src", "stream"} <= set(_params(PyNcclCommunicator.broadcast))
    assert callable(PyNcclCommunicator.destroy)
    assert {"host", "port", "rank", "world_size"} <= set(_params(StatelessProcessGroup.create))


def test_worker_extension_resolves_and_does_not_clash_with_the_gpu_worker():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert resolve_obj_by_qualname(vllm_engine.EXTENSION) is vllm_engine.CovrlWorkerExtension
    ours = [a for a in dir(vllm_engine.CovrlWorkerExtension) if not a.startswith("__")]
    assert ours and not [a for a in ours if hasattr(Worker, a)], "vLLM refuses extension attributes the worker has"
    assert callable(GPUModelRunner.get_model)
    src = inspect.getsource(Worker)
    for attr in ("self.model_runner", "self.device", "self.rank"):
        assert attr in src or attr in inspect.getsource(Worker.__mro__[1]), f"the extension reads {attr}"


def test_name_map_agrees_with_vllms_qwen2_mapper(tiny_model_dir):
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    mapper = Qwen2ForCausalLM.hf_to_vllm_mapper
    lay = weights.layout(vllm_engine.meta_model(tiny_model_dir))
    for name in lay.names:
        assert mapper._map_name_with_shard(name) == vllm_weights.vllm_target(name), name


def test_rpc_weight_buckets_survive_vllms_utility_channel():
    """collective_rpc arguments cross the frontend -> engine-core socket through vLLM's msgpack codec, decoded
    without a target type: a tensor arrives as [dtype, shape, buffer] (not a tensor), bytes arrive as bytes.
    So load_flat sends bytes and the worker extension rebuilds the bucket."""
    from types import SimpleNamespace

    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    lay = weights.Layout(("model.norm.weight", "model.layers.0.mlp.up_proj.weight"), ((64,), (256, 64)))
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(0))
    meta = vllm_weights.bucket_meta(lay, 0, 2, torch.bfloat16)
    args = (meta["names"], meta["shapes"], meta["dtype_names"][0], vllm_engine.rpc_bytes(flat, torch.bfloat16))
    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    got = dec.decode(enc.encode(("covrl_load_weights", None, args, None)))
    loaded = {}
    worker = vllm_engine.CovrlWorkerExtension()
    worker.device = torch.device("cpu")
    worker.model_runner = SimpleNamespace(get_model=lambda: SimpleNamespace(load_weights=lambda pairs: loaded.update(pairs)))
    worker.covrl_load_weights(*got[2])
    assert list(loaded) == list(lay.names)
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], flat[64:].view(256, 64).to(torch.bfloat16))
    assert not isinstance(dec.decode(enc.encode((flat.to(torch.bfloat16),)))[0], torch.Tensor)
