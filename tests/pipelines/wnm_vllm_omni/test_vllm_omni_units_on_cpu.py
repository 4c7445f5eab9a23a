"""Pure parts of the vllm_omni backend: request mapping, result assembly, weight buckets and versions, the
missing-extra error, and that ``import verl_omni`` never imports vllm."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from verl_omni.data.actions import ActionLayout, ActionNormalization
from verl_omni.pipelines.wnm_shared import JointLayout, RolloutRequest
from verl_omni.pipelines.wnm_vllm_omni import extra
from verl_omni.pipelines.wnm_vllm_omni.protocol import (
    ProtocolError,
    assemble_results,
    request_from_payload,
    request_payload,
)
from verl_omni.pipelines.wnm_vllm_omni.weight_sync import (
    WeightReceiver,
    WeightSyncError,
    full_tensor_source,
    iter_buckets,
    mapping_source,
    plan_buckets,
)

LAYOUT = JointLayout((2, 1, 2, 2), ActionLayout())  # 8 video dims + 128 action dims
NORM = ActionNormalization(mean=(0.0, 0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0, 1.0))


def test_request_round_trip_and_refusals():
    r = RolloutRequest("scene/ep 3", stratum=2, branch=3, step=9, seed=4, context_row=1, num_steps=10)
    p = request_payload(r, "key", "sde", expected_weight_version=5)
    assert p["context_key"] == "key" and p["expected_weight_version"] == 5 and p["mode"] == "sde"
    assert request_from_payload(p) == r
    with pytest.raises(ProtocolError, match="wire version"):
        request_from_payload({**p, "wire": 0})
    with pytest.raises(ProtocolError, match="lacks"):
        request_from_payload({k: v for k, v in p.items() if k != "seed"})
    with pytest.raises(ProtocolError, match="mode"):
        request_payload(r, "key", "euler")


def _output(rid, version=1, w=2, value=0.0):
    n = LAYOUT.numel
    return {
        "request_id": rid,
        "final": torch.full((n,), value),
        "window_states": torch.zeros(w + 1, n),
        "logprobs": torch.zeros(w, 9),
        "window_steps": torch.tensor([3, 4][:w]),
        "noise_coefs": torch.zeros(w, dtype=torch.float64),
        "weight_version": version,
    }


def test_assemble_orders_by_request_and_checks_ids_and_versions():
    reqs = [RolloutRequest("a", 0, b, 0, 0) for b in range(3)]
    outs = [_output(r.request_id, value=float(i)) for i, r in enumerate(reqs)]
    res = assemble_results(reqs, outs[::-1], torch.linspace(1, 0, 6, dtype=torch.float64), LAYOUT, NORM)
    assert res.request_ids == [r.request_id for r in reqs] and res.weight_version == 1
    assert res.video_latents[:, 0, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert res.actions.shape == (3, 32, 4) and res.logprobs.shape == (3, 2, 9)
    with pytest.raises(ProtocolError, match="missing"):
        assemble_results(reqs, outs[:2], torch.zeros(6), LAYOUT, NORM)
    with pytest.raises(ProtocolError, match="duplicate"):
        assemble_results(reqs, outs + outs[:1], torch.zeros(6), LAYOUT, NORM)
    with pytest.raises(ProtocolError, match="several weight versions"):
        assemble_results(reqs, outs[:2] + [_output(reqs[2].request_id, version=2)], torch.zeros(6), LAYOUT, NORM)
    bad = _output(reqs[0].request_id)
    bad["logprobs"] = torch.zeros(3, 9)
    with pytest.raises(ProtocolError, match="do not fit"):
        assemble_results(reqs[:1], [bad], torch.zeros(6), LAYOUT, NORM)


def test_plan_buckets_by_hand():
    sizes = [("a", 40), ("b", 30), ("c", 100), ("d", 10), ("e", 20), ("f", 75)]
    # budget 80: a+b=70 | c=100 alone (too big) | d+e=30, +f would be 105 | f
    assert plan_buckets(sizes, 80) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert plan_buckets(sizes, 10**9) == [["a", "b", "c", "d", "e", "f"]]
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("a", 1), ("a", 1)], 10)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))


def test_receiver_versions_order_and_atomicity():
    src, dst = Small(), Small()
    with torch.no_grad():
        src.lin.weight.fill_(2.0)
    sizes, source = full_tensor_source(src)  # plain tensors pass through (DTensors would be all-gathered)
    plan = plan_buckets(sizes, 60)  # state-dict order: scale 12 B | lin.weight 48 B + lin.bias 12 B would be 60
    assert plan == [["scale", "lin.weight"], ["lin.bias"]]
    rx = WeightReceiver(dst)
    buckets = list(iter_buckets(plan, source, version=3))
    rx.begin(3, len(buckets))
    rx.load(buckets[0])
    assert not rx.ready and "open" in rx.status()
    with pytest.raises(WeightSyncError, match="repeated"):
        rx.load(buckets[0])
    assert not rx.ready and "broke off" in rx.status()
    rx.begin(3, len(buckets))  # a retry sends the full set again
    for b in buckets:
        rx.load(b)
    assert rx.commit(3) == 3 and rx.ready and torch.equal(dst.lin.weight, src.lin.weight)
    with pytest.raises(WeightSyncError, match="backwards"):
        rx.begin(2, 1)
    rx.begin(4, 2)
    rx.load(next(iter_buckets([["lin.weight"]], source, 4)).__class__(4, 0, 2, {"lin.weight": src.lin.weight}))
    with pytest.raises(WeightSyncError, match="1/2 buckets"):
        rx.commit(4)
    assert rx.version == 3 and not rx.ready
    with pytest.raises(WeightSyncError, match="unknown tensor name"):
        rx.begin(5, 1)
        rx.load(next(iter_buckets([["x"]], mapping_source({"x": torch.zeros(1)}), 5)))
    with pytest.raises(WeightSyncError, match="shape"):
        rx.begin(5, 1)
        rx.load(next(iter_buckets([["scale"]], mapping_source({"scale": torch.zeros(2)}), 5)))


def test_missing_extra_names_extra_and_install_command(monkeypatch):
    monkeypatch.setattr(extra, "REQUIRED_MODULES", {"vllm": "no_such_module_vllm", "vllm-omni": "no_such_vllm_omni"})
    msg = extra.missing_extra_message()
    assert "'vllm-omni' extra" in msg and extra.INSTALL_COMMAND in msg and "vllm, vllm-omni are not installed" in msg
    with pytest.raises(extra.MissingExtraError, match="pip install"):
        extra.require_vllm_omni()

    from verl_omni.models.wnm import WNMConfig, build_wnm_model
    from verl_omni.pipelines import wnm_3d

    model = build_wnm_model(WNMConfig.from_size("tiny", variant="wnm_3d"))
    with pytest.raises(extra.MissingExtraError, match=r"rollout backend 'vllm_omni' needs the 'vllm-omni' extra"):
        wnm_3d.build_backend(model, backend="vllm_omni")


def test_import_verl_omni_does_not_import_vllm():
    code = (
        "import sys, verl_omni, verl_omni.pipelines.wnm_shared, verl_omni.pipelines.wnm_vllm_omni.backend, "
        "verl_omni.pipelines.wnm_vllm_omni.pipeline, verl_omni.pipelines.wnm_vllm_omni.ray_actor, "
        "verl_omni.trainer.contract_check\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
