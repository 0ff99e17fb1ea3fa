"""The zoo GPT's fused query-key-value linear (``GPTConfig.fused_qkv``): one ``Linear(C, 3C)``
whose output is viewed per head as [q k v], Megatron-LM's layout
(``megatron/model/transformer.py`` ParallelAttention: ``mixed_x_layer.view(..., np, 3·hn)``
split into three on its last dim), computing what the three separate linears compute."""

from __future__ import annotations

import torch

from soapsearch import trace, zoo


def _fused_from(separate: torch.nn.Module, fused: torch.nn.Module, heads: int) -> None:
    """Copy ``separate``'s weights into ``fused``: each block's q, k, v rows stacked per head
    ([q_0 k_0 v_0 q_1 k_1 v_1 ...]), every other parameter as it is."""
    target = dict(fused.named_parameters())
    with torch.no_grad():
        for name, p in separate.named_parameters():
            if name.endswith(("attn.q.weight", "attn.q.bias")):
                stem, leaf = name.rsplit(".q.", 1)
                parts = [dict(separate.named_parameters())[f"{stem}.{x}.{leaf}"] for x in "qkv"]
                per_head = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in parts], dim=1)
                target[f"{stem}.qkv.{leaf}"].copy_(per_head.reshape(-1, *p.shape[1:]))
            elif ".attn.k." not in name and ".attn.v." not in name:
                target[name].copy_(p)


def test_fused_qkv_computes_the_three_linears():
    """Loss and every gradient equal (float64, dropout 0) once the three linears' rows are laid
    out per head as Megatron-LM's fused linear holds them; a [q | k | v] block layout (nanoGPT's
    ``c_attn``) would pair head i's query with another head's key and differ."""
    kw = dict(n_head=4, n_embd=32, dropout=0.0)
    separate, inputs = zoo.build("gpt", "tiny", **kw)
    fused, _ = zoo.build("gpt", "tiny", fused_qkv=True, **kw)
    separate, fused = separate.double(), fused.double()
    _fused_from(separate, fused, heads=4)
    a, b = separate(*inputs), fused(*inputs)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-12, atol=0)
    grads = dict(fused.named_parameters())
    for name in ("blocks.0.attn.proj.weight", "blocks.1.mlp.fc.weight", "wte.weight", "wpe"):
        torch.testing.assert_close(grads[name].grad, dict(separate.named_parameters())[name].grad,
                                   rtol=1e-10, atol=1e-14)
    q = separate.blocks[0].attn.q.weight.grad
    torch.testing.assert_close(fused.blocks[0].attn.qkv.weight.grad.view(4, 3, 8, 32)[:, 0], q.view(4, 8, 32),
                               rtol=1e-10, atol=1e-14)


def test_fused_qkv_traces_one_linear_per_attention():
    model, inputs = zoo.build("gpt", "tiny", fused_qkv=True)
    g = trace(model, inputs, name="gpt-fused")
    linears = [n for n in g if n.kind == "linear"]
    assert g.capture == "fx"
    assert [n.name for n in linears] == ["blocks_0_attn_qkv", "blocks_0_attn_proj", "blocks_0_mlp_fc",
                                         "blocks_0_mlp_proj", "blocks_1_attn_qkv", "blocks_1_attn_proj",
                                         "blocks_1_mlp_fc", "blocks_1_mlp_proj", "lm_head"]
    assert g["blocks_0_attn_qkv"].output.shape == (4, 8, 48)  # 3 · n_embd 16
    separate = trace(*zoo.build("gpt", "tiny"), name="gpt")
    # the same FLOPs as q, k and v
    assert g["blocks_0_attn_qkv"].flops == sum(separate[f"blocks_0_attn_{x}"].flops for x in "qkv")
