"""Mixture of experts (distrain.models.moe) and expert parallelism (distrain.parallel.expert_parallel):
the router (softmax and sigmoid gating, top-k renormalized), the load-balancing loss against the hand
formula and Hugging Face's, its gradient added through the layer's output, capacity dropping counted;
Hugging Face Mixtral logits equal to ours within 1e-5 in fp32 both ways (transformers 5's fused
experts and the published per-expert names); the Topology's ep and edp groups; an expert-parallel
layer on 2 ranks against one process (output and every gradient, fp64) and a training step's
all-to-all bytes against the routing; every bad input refused in one line before start.

The trainer's equivalence runs (ep2, ep2 with 2 expert replicas) are in tests/test_moe_train.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import distrain
from distrain import comm
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.models.moe import MoEConfig, MoEFeedForward, drop_over_capacity, load_balance_loss, moe_metrics, route
from distrain.parallel.expert_parallel import ep_bytes
from distrain.topology import Topology

from conftest import assert_refused, trainer_config


def _layer(seed=0, dtype=torch.float64, **moe) -> MoEFeedForward:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, **moe})
    layer = MoEFeedForward(8, 12, cfg).to(dtype)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 1.0)  # routing that differs between tokens
    return layer


def test_router_softmax_and_sigmoid_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    ids, w, p = route(logits, MoEConfig(num_experts=4, top_k=2))
    assert ids.tolist() == [[0, 1], [1, 3]]
    e = math.exp(1.0)
    assert w[0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)], rel=1e-12)  # top-2 of softmax, renormalized
    assert p.sum(-1).tolist() == pytest.approx([1.0, 1.0])
    ids, w, p = route(logits, MoEConfig(num_experts=4, top_k=2, gating="sigmoid", norm_topk=False))
    s = torch.sigmoid(logits)
    assert ids.tolist() == [[0, 1], [1, 3]] and torch.equal(w, torch.stack([s[0, [0, 1]], s[1, [1, 3]]]))
    assert torch.allclose(p, s / s.sum(-1, keepdim=True))  # the balance loss's distribution


def test_aux_loss_is_the_hand_formula_and_hugging_faces():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layer = _layer(aux_loss_coef=0.1).train()
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layer(x)
    logits = layer.gate(x.reshape(15, 8)).detach()
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, dim=-1).indices
    f = torch.stack([(top == i).any(-1).double().sum() / 15 for i in range(4)])  # slots to i per token
    hand = 0.1 * 4 * (f * probs.mean(0)).sum()
    assert layer.aux_loss.item() == pytest.approx(hand.item(), rel=1e-12)
    assert layer.aux_loss.item() == pytest.approx(0.1 * load_balancing_loss_func((logits,), 4, 2).item(), rel=1e-6)
    assert load_balance_loss(torch.full((4,), 0.5), torch.full((4,), 0.25), 1.0).item() == 2.0  # balanced: k


def test_aux_loss_reaches_the_router_gradient():
    """loss.backward() through the layer's output gives d(loss + aux): the router's gradient equals the
    gradient of the loss plus the aux loss written out by hand."""
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    layer = _layer(aux_loss_coef=0.5).train()
    layer(x).pow(2).sum().backward()
    got = layer.gate.weight.grad.clone()
    ref = _layer(aux_loss_coef=0.5)
    ref.moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.0)  # the same weights, no aux of its own
    flat = x.reshape(12, 8)
    ids, _, p = route(ref.gate(flat), ref.moe)
    f = torch.bincount(ids.reshape(-1), minlength=4).double() / 12
    (ref(x).pow(2).sum() + load_balance_loss(f, p.mean(0), 0.5)).backward()
    assert torch.allclose(got, ref.gate.weight.grad, rtol=1e-12, atol=0)
    assert not torch.allclose(got, _grad_without_aux(x), rtol=1e-3)


def _grad_without_aux(x):
    layer = _layer(aux_loss_coef=0.0).train()
    layer(x).pow(2).sum().backward()
    return layer.gate.weight.grad


def test_capacity_drops_slots_in_priority_order_and_counts_them():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 chosen 4 times (3 first choices)
    kept, dropped = drop_over_capacity(ids, 4, capacity=2)
    # first choices before second ones: tokens 0, 1 keep expert 0; token 2's first choice and token 3's second drop
    assert kept.tolist() == [[0, 1], [0, 2], [-1, 1], [3, -1]] and int(dropped) == 2
    layer = _layer(capacity_factor=0.5).train()  # capacity ceil(0.5 * 12 * 2 / 4) = 3 slots per expert
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    ids, w, _ = route(layer.gate(x.reshape(12, 8)), layer.moe)
    want_kept, want_dropped = drop_over_capacity(ids, 4, 3)
    assert int(want_dropped) > 0 and moe_metrics(layer) == {"moe_dropped": int(want_dropped), "moe_routed": 24}
    from distrain.models.experts import run_experts

    experts = {int(e): m for e, m in layer.experts.items()}
    assert torch.allclose(y.reshape(12, 8), run_experts(x.reshape(12, 8), want_kept, w, experts), rtol=1e-12)
    unlimited = _layer().train()
    unlimited(x)
    assert moe_metrics(unlimited) == {"moe_dropped": 0, "moe_routed": 24}


def _mixtral(seed=0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    c = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    model = MixtralForCausalLM(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # a router that sends tokens to different experts
    return model


def test_mixtral_logits_equal_ours_both_ways():
    from transformers import MixtralConfig, MixtralForCausalLM

    from distrain.models.llama import Llama
    from distrain.models.llama.hf import from_hf, to_hf

    hf = _mixtral()
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(4))
    cfg, sd = from_hf(hf.state_dict(), hf.config.to_dict())
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.gating, cfg.moe.aux_loss_coef) == (4, 2, "softmax", 0.02)
    ours = Llama(cfg).eval()
    ours.load_state_dict(sd)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert ref.dtype == torch.float32 and torch.allclose(got, ref, rtol=0, atol=1e-5)
    # the published (transformers 4) per-expert names read alike
    hub = {}
    for n, t in hf.state_dict().items():
        if n.endswith("experts.gate_up_proj"):
            for e in range(4):
                pre = n.replace("mlp.experts.gate_up_proj", f"block_sparse_moe.experts.{e}.")
                hub[pre + "w1.weight"], hub[pre + "w3.weight"] = t[e, :48], t[e, 48:]
        elif n.endswith("experts.down_proj"):
            for e in range(4):
                hub[n.replace("mlp.experts.down_proj", f"block_sparse_moe.experts.{e}.w2.weight")] = t[e]
        else:
            hub[n.replace("mlp.gate", "block_sparse_moe.gate")] = t
    assert all(torch.equal(sd[k], v) for k, v in from_hf(hub, hf.config.to_dict())[1].items())
    # ours -> Mixtral
    torch.manual_seed(5)
    mine = build_model("llama-moe-tiny").eval()
    hf_sd, hf_cfg = to_hf(mine.state_dict(), mine.config)
    back = MixtralForCausalLM(MixtralConfig(**hf_cfg)).eval()
    back.load_state_dict(hf_sd, strict=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.allclose(back(x).logits, mine(x), rtol=0, atol=1e-5)


def test_what_mixtral_cannot_hold_is_refused():
    from distrain.models.llama.hf import config_from_hf, to_hf

    m = build_model("llama-moe-tiny", moe=dict(num_experts=4, top_k=2, gating="sigmoid", shared_expert_size=16))
    with pytest.raises(ConfigError, match=r"^to_hf: the Mixtral layout has no place for moe gating='sigmoid' "
                                          r"\(Mixtral: 'softmax'\), shared_expert_size=16 \(Mixtral: 0\)$"):
        to_hf(m.state_dict(), m.config)
    with pytest.raises(ConfigError, match="sliding_window=16 .* is not supported"):
        config_from_hf(dict(_mixtral().config.to_dict(), sliding_window=16))


def test_topology_ep_and_edp_groups():
    t = Topology(dp=4, ep=2, rank=3)
    assert (t.groups_of("ep"), t.groups_of("edp"), t.ep_rank, t.ep_ranks, t.edp_ranks) == (
        [[0, 1], [2, 3]], [[0, 2], [1, 3]], 1, [2, 3], [1, 3])
    t = Topology(dp=2, cp=2, tp=2, ep=4, rank=5)  # ep borrows dp x cp: each ep group spans a whole dp_cp group
    assert t.groups_of("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]] and t.size_of("edp") == 1 and t.ep_rank == 2
    with pytest.raises(ConfigError, match=r"^ep=2 does not divide dp\*cp = 3: expert parallelism borrows its ranks "
                                          r"from the data-parallel ones; choose ep among 1, 3$"):
        Topology(dp=3, ep=2)


@pytest.mark.parametrize("kw,message", [
    (dict(ep=3, nproc=3), "--ep 3 does not divide llama-moe-tiny's 4 experts (every rank holds num_experts / ep whole "
                          "experts); choose --ep among 1, 2, 4"),
    (dict(ep=4, nproc=2), "--ep 4 does not divide dp x cp = 2 (expert parallelism borrows its ranks from the "
                          "data-parallel ones: each ep group is ep of the ranks that share the other parameters); "
                          "choose --ep among 1, 2, or more --nproc"),
    (dict(ep=2, nproc=2, model="llama-tiny"), "--ep 2: llama-tiny has no experts to split (expert parallelism places "
                                              "a mixture of experts' experts on different ranks); use a "
                                              "mixture-of-experts model, e.g. --model llama-moe-tiny, or drop --ep"),
    (dict(ep=2, nproc=4, pp=2), "--pp 2: llama-moe-tiny is a mixture of experts, which does not compose with --pp "
                                "here (the load-balancing loss's gradient is added once per forward, not per "
                                "micro-batch); use --dp, --cp and --ep"),
    (dict(ep=2, nproc=4, tp=2), None),  # tp x ep: the mixture whole on every tp rank (tests/test_moe_train.py)
    (dict(ep=2, nproc=2, strategy="zero2"), "--ep 2 does not compose with --strategy zero2"),
    (dict(ep=2, dp=2, nproc=4), "--ep 2 --dp 2 --nproc 4: expert parallelism borrows its ranks from dp x cp"),
    (dict(ep=2, nproc=2, accum_steps=2, strategy="ddp"), "--accum-steps 2: llama-moe-tiny's load-balancing loss"),
    (dict(ep=0, nproc=2), "--tp, --pp, --cp, --ep and --microbatches must be >= 1"),
    (dict(ep=2, nproc=2), None),
    (dict(ep=2, cp=2, nproc=4), None),
])
def test_bad_ep_is_refused_before_any_rank_starts(tmp_path, kw, message):
    assert_refused(trainer_config(tmp_path / "bad", **{"model": "llama-moe-tiny", **kw}), message)


def _layer_rank(rank: int, capacity: float) -> list[str]:
    """2 ranks, ep 2: rank r holds experts 2r, 2r+1 and sample r (6 tokens) of a 2-sample batch; its output,
    input gradient and experts' gradients equal one process's on the whole batch, and the router's
    gradients summed over the ranks equal one process's with twice the aux coefficient (each rank's
    aux is the step's aux: P ranks add it P times to the summed objective)."""
    import torch.distributed as dist
    import torch.nn as nn

    from distrain.models.experts import ALL_HERE
    from distrain.parallel.expert_parallel import EPPlan, ExpertParallel, apply_expert_parallel, \
        reduce_expert_gradients

    problems = []
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    dy = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ref = _layer(aux_loss_coef=0.2, capacity_factor=capacity).train()
    xr = x.clone().requires_grad_()
    out = ref(xr)
    (out * dy).sum().backward()
    assert ref.dispatch is ALL_HERE
    layer = _layer(aux_loss_coef=0.1, capacity_factor=capacity).train()
    apply_expert_parallel(nn.ModuleDict({"ffn": layer}), ExpertParallel(dist.group.WORLD, dist.group.WORLD),
                          plan=EPPlan(modules=("ffn",)))
    if sorted(layer.experts) != [str(2 * rank), str(2 * rank + 1)]:
        problems.append(f"rank {rank} holds experts {sorted(layer.experts)}")
    mine = x[rank:rank + 1].clone().requires_grad_()
    y = layer(mine)
    (y * dy[rank:rank + 1]).sum().backward()
    reduce_expert_gradients(list(layer.experts.parameters()), None, 1)  # no replicas; the objective is a sum
    gate = layer.gate.weight.grad.clone()
    comm.all_reduce(gate, op="sum")
    if not torch.allclose(y, out[rank:rank + 1].detach(), rtol=1e-12, atol=1e-14):
        problems.append("output differs")
    if not torch.allclose(mine.grad, xr.grad[rank:rank + 1], rtol=1e-10, atol=1e-14):
        problems.append("input gradient differs")
    if not torch.allclose(gate, ref.gate.weight.grad, rtol=1e-10, atol=1e-14):
        problems.append("router gradient differs")
    want = dict(ref.experts.named_parameters())
    for n, p in layer.experts.named_parameters():
        if not torch.allclose(p.grad, want[n].grad, rtol=1e-10, atol=1e-14):
            problems.append(f"expert parameter {n}: gradient differs")
    if moe_metrics(layer) != moe_metrics(ref):  # the drop tally is summed over the ranks: the whole batch's
        problems.append(f"metrics {moe_metrics(layer)} != {moe_metrics(ref)}")
    return problems


@pytest.mark.timeout(90)
def test_expert_parallel_layer_equals_one_process():
    assert distrain.spawn(_layer_rank, 2, args=(0.0,), timeout=75) == [[], []]


def _step_bytes_rank(rank: int) -> dict:
    """One training step of llama-moe-tiny under ep 2 (fp64): the ledger's ep-all-to-all bytes, and the
    routing matrix every rank's router made (captured from the gate's output)."""
    from distrain.models.registry import model_ep_plan
    from distrain.parallel import parallelize
    import torch.distributed as dist

    torch.manual_seed(0)
    net = build_model("llama-moe-tiny").double()
    topo = Topology.from_world(dp=2, ep=2)
    pm = parallelize(net, topo, loss_fn=lm_loss, ep_plan=model_ep_plan(net))
    routed = []  # per layer: (ep, ep) kept slots from rank i's tokens to experts on rank j
    for m in net.modules():
        if isinstance(m, MoEFeedForward):
            def hook(gate, inp, out, cfg=m.moe):
                ids, _, _ = route(out.detach(), cfg)
                mine = torch.bincount(ids.reshape(-1) // 2, minlength=2)  # experts 0,1 on rank 0; 2,3 on rank 1
                both = [torch.zeros_like(mine) for _ in range(2)]
                dist.all_gather(both, mine)
                routed.append(torch.stack(both))
            m.gate.register_forward_hook(hook)
    ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(3))
    x, y = ids[rank * 4:(rank + 1) * 4, :-1], ids[rank * 4:(rank + 1) * 4, 1:]
    with comm.ledger() as led:
        pm.train_step(x, y)
    got = led.get("ep-all-to-all", "p2p")
    counts = led.get("ep-counts", "p2p")
    return {"sent": got.bytes_sent, "recv": got.bytes_recv, "msgs": got.msgs_sent, "count_bytes": counts.bytes_sent,
            "routed": [r.tolist() for r in routed]}


@pytest.mark.timeout(90)
def test_a_training_step_sends_the_routing_bytes():
    """Per MoE layer, rank r sends 2 (S_r + R_r) C e bytes (dispatch + combine, forward + backward),
    S_r: its slots routed to the other rank's experts, R_r: the other rank's slots routed to its experts."""
    results = distrain.spawn(_step_bytes_rank, 2, timeout=75)
    for r, res in enumerate(results):
        assert len(res["routed"]) == 2  # two layers
        want = [ep_bytes(torch.tensor(m), C=64, elem_size=8)[r] for m in res["routed"]]
        assert all(m[0][1] + m[1][0] > 0 for m in res["routed"])  # tokens did cross
        assert (res["sent"], res["recv"], res["msgs"]) == (sum(w["sent"] for w in want), sum(w["recv"] for w in want),
                                                           sum(w["msgs_sent"] for w in want))
        assert res["count_bytes"] == 2 * 2 * 8  # per layer one message of E/ep = 2 int64 to the other rank


def test_ep_bytes_formula():
    routed = torch.tensor([[5, 3], [0, 7]])  # rank 0: 3 slots to rank 1's experts; rank 1: none to rank 0's
    assert ep_bytes(routed, C=4, elem_size=8) == [
        {"sent": 2 * 3 * 32, "recv": 2 * 3 * 32, "msgs_sent": 2},   # dispatch to 1 + backward of the combine
        {"sent": 2 * 3 * 32, "recv": 2 * 3 * 32, "msgs_sent": 2}]   # combine back to 0 + dispatch's backward


def test_presets_and_planner_shapes():
    from distrain.costmodel.shapes import preset_shape
    from distrain.models import count_parameters

    tiny = build_model("llama-moe-tiny")
    assert count_parameters(tiny) == 254_784 == preset_shape("llama-moe-tiny").params()
    with torch.device("meta"):
        mixtral = build_model("mixtral-8x7b")
    s = preset_shape("mixtral-8x7b")
    assert count_parameters(mixtral) == s.params() == 46_702_792_704  # Mixtral 8x7B's published 46.7B
    assert (s.experts, s.top_k, s.ffn) == (8, 2, 14336) and s.active_matmul_params() == 12_747_538_432


@pytest.mark.timeout(120)
def test_a_run_exports_as_a_mixtral_folder_and_imports_back(tmp_path):
    """`distrain checkpoint export --hf` of an ep2 run (its shards joined) loads in transformers'
    MixtralForCausalLM with our logits; `import --hf` of that folder names the preset again."""
    from transformers import MixtralForCausalLM

    from distrain.checkpoint.hf import export_hf, import_hf
    from distrain.checkpoint.reshard import consolidate

    cfg = trainer_config(tmp_path / "run", model="llama-moe-tiny", ep=2, nproc=2, steps=2, dtype="float32")
    distrain.train(cfg)
    config = export_hf(cfg.out, tmp_path / "hf")
    assert (config["architectures"], config["model_type"], config["num_local_experts"]) == (
        ["MixtralForCausalLM"], "mixtral", 4)
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = build_model("llama-moe-tiny").eval()
    ours.load_state_dict(consolidate(cfg.out)["model"])
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x), rtol=0, atol=1e-5)
    assert import_hf(tmp_path / "hf", tmp_path / "back")["model"] == "llama-moe-tiny"


def test_tensor_parallel_plans_leave_the_mixture_whole():
    """The Llama's tp plan splits attention but leaves every mixture (``tp_replicated``) and all it
    contains alone; with sequence parallelism (activations as sequence shards) it is refused."""
    from distrain.models import build_model
    from distrain.models.llama.plan import llama_tp_plan
    from distrain.parallel.tensor_parallel.plan import _resolve

    model = build_model("llama-moe-tiny")
    names = [n for n, _, _ in _resolve(model, llama_tp_plan())]
    assert "layers.1.attention.wq" in names and not [n for n in names if ".feed_forward" in n]
    with pytest.raises(ConfigError, match=r"^apply_tensor_parallel: layers\.1\.feed_forward is kept whole on every "
                                          r"rank \(tp_replicated\).*use sequence_parallel=False$"):
        _resolve(model, llama_tp_plan(sequence_parallel=True))
