"""Tiny target/draft checkpoints, written at test time into a directory of the caller's.

**The anchored target** (llama, deepseek_v3): a random model (every layer's stream is
different and rich) with two reserved residual dimensions that pin its behaviour down:

- dim ``C0``: the embedding of an *anchor* token (``Z`` and every multiple of 8) holds
  ``C`` there, every other token 0; no layer writes ``C0`` (rows ``C0`` of every
  ``o_proj`` and ``down_proj`` are zero), so at every layer a position's ``C0`` is its
  own token's;
- dim ``D1``: nothing writes it (embedding column and all output rows zero) except one
  unit of the *last* layer's MLP (the shared expert's, for MoE), whose gate and up
  read only ``C0``: it adds ``silu(g * n0) * u * n0 > 0`` at anchor positions (n0 the
  normed ``C0``), 0 elsewhere. So ``D1 > 0`` in the last layer's output, and only there.
- ``lm_head``: row ``Z`` is ``BIG * e_C0``, no other row reads ``C0`` or ``D1``.

- dim ``E2``: only the embedding of the *lead* token ``W`` holds ``C`` there, no layer
  writes it, and ``lm_head`` row ``A_W`` (an anchor) reads only it (``BIG``).

Its greedy token after an anchor is ``Z`` (an anchor), whatever came before: from the
first anchor on it generates ``Z`` forever. After ``W`` it says ``A_W``, so a prompt
ending in ``W`` leads into the ``Z`` regime one token late. After other tokens it is a
random model.

Every tensor transformers initialises to a constant (the norm weights) is perturbed
(``perturb``), so the captures' values depend on each norm weight; the reserved
dimensions of every hidden-size norm weight are made positive, so the construction
holds on either side of a norm.

**The exact EAGLE3 draft**: ``fc`` passes the slot of the target's last layer through
(identity), the decoder layer adds nothing (``o_proj`` and ``down_proj`` zero, so every
draft step carries the same hidden), and its ``lm_head`` has two rows: ``Z`` reads
``D1`` (weight ``A``), ``Z_DECOY`` reads ``C0`` (weight ``B``, with ``B * C < A * D1``).
It predicts ``Z`` exactly when the value in that slot is the target's last-layer output
at an anchor position; a missing capture, an off-by-one layer or any other value there
(``D1 = 0``) makes it predict ``Z_DECOY``, which the target rejects. Once the target is
in its ``Z`` regime, every draft token is accepted: accept length = steps + 1. After
``W`` it is wrong (``D1 = 0`` there): with a prompt ending in ``W`` the first round
accepts nothing, and every later round, drafted from the captures of a *verify*
forward (at ``A_W`` and after), accepts everything.

**The exact DFlash draft** does the same through attention: ``fc`` passes the last
layer's slot, the context values read ``D1`` and ``o_proj`` writes it into ``C0`` of
the block's hidden states, which the target's ``lm_head`` turns into ``Z``.

**The partial EAGLE3 draft** is the exact one with two units in its MLP and a scratch
dimension ``M`` of its own (``fc`` leaves ``M`` out of the capture, so the first step of a
round sees ``M = 0``): unit A writes ``M > 0`` wherever ``C0`` is set (every draft step
at an anchor), unit B reads ``M`` and writes ``-KNOCK`` into ``D1``. The first step of a
round, drafted from the target's captures, has ``M = 0`` on its input: unit B is silent
and the draft predicts ``Z`` as the exact draft does. Every later step is drafted from
the draft's own hidden state, which holds unit A's ``M`` from the step before: ``D1``
turns negative and it predicts ``Z_DECOY``. In the ``Z`` regime every round accepts 1 of
its 3 draft tokens (accept length 2), so the target's verify forwards hold rejected
tokens after accepted ones.

The *random* drafts are plain random weights: acceptance is low, the outputs must still
equal the target's.

Weights are float32, written with ``save_pretrained`` (targets, then edited in the
safetensors file by name) or safetensors (drafts), each with the local tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.e2e import tokenizer

H = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
FFN = 128
VOCAB = tokenizer.VOCAB
Z = 8            # the anchored target's token from the first anchor on
Z_DECOY = 9      # what the exact draft predicts when the capture is wrong
W = 13           # the lead token: the target says A_W after it
A_W = 24         # an anchor
C0, D1, E2 = 0, 1, 2  # reserved residual dimensions
M_DIM = 3            # the partial draft's own scratch dimension (its fc drops the capture's)
KNOCK = 10.0         # the partial draft's unit B: D1 -= KNOCK * silu(G nM) U nM
MARK_UNIT = 0    # the last layer's MLP unit that writes D1
C = 1.0
BIG = 60.0       # target lm_head[Z, C0]
A, B = 200.0, 1.0  # exact draft lm_head[Z, D1], lm_head[Z_DECOY, C0]
G = U = 3.0      # the marker unit's gate/up weight on C0
SIGMA = 0.15     # random weights
PERTURB_SCALE = 0.3  # noise on what transformers initialises to a constant


def anchors() -> list[int]:
    return [t for t in range(VOCAB) if t % 8 == 0 and t >= 8]


def is_anchor(token: int) -> bool:
    return token >= 8 and token % 8 == 0


@dataclass(frozen=True)
class Target:
    path: Path
    family: str        # "llama" | "deepseek_v3"
    layers: int


def _save_tokenizer(path: Path) -> None:
    tokenizer.save(path)


def _edit_safetensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"{path}: expected one safetensors file, found {len(files)}")
    tensors = load_file(str(files[0]))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(files[0]), metadata={"format": "pt"})


def perturb(model, seed: int = 7) -> list[str]:
    """Add seeded noise (``PERTURB_SCALE``) to every floating tensor of ``model``'s state
    dict that holds one constant: what transformers initialises norm weights (1, or 0
    for Gemma's ``1 + w``), biases and router correction biases to. Tensors a family's
    ``prepare`` already set (GPT-OSS's sinks) are left as they are. Returns the names."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    done = []
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if not data.is_floating_point() or data.numel() == 0:
                continue
            flat = data.reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            noise = torch.randn(data.shape, generator=gen) * PERTURB_SCALE
            data.add_(noise.to(data.dtype))
            done.append(name)
    return done



def _randomize(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * SIGMA)


def _anchor(tensors: dict, layers: int, marker_prefix: str) -> None:
    """The anchored construction (module docstring) on an HF state dict."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    emb = tensors["model.embed_tokens.weight"]
    emb.copy_(torch.randn(emb.shape, generator=gen) * 0.5)
    emb[:, C0] = 0.0
    emb[:, D1] = 0.0
    emb[:, E2] = 0.0
    emb[anchors(), C0] = C
    emb[W, E2] = C
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[C0, :] = 0.0
            t[D1, :] = 0.0
            t[E2, :] = 0.0
        elif name.endswith("norm.weight") and tuple(t.shape) == (H,):
            t[[C0, D1, E2]] = t[[C0, D1, E2]].abs()
    gate = tensors[f"{marker_prefix}.gate_proj.weight"]
    up = tensors[f"{marker_prefix}.up_proj.weight"]
    down = tensors[f"{marker_prefix}.down_proj.weight"]
    gate[MARK_UNIT, :] = 0.0
    gate[MARK_UNIT, C0] = G
    up[MARK_UNIT, :] = 0.0
    up[MARK_UNIT, C0] = U
    down[D1, MARK_UNIT] = 1.0
    head = tensors["lm_head.weight"]
    head[:, C0] = 0.0
    head[:, D1] = 0.0
    head[:, E2] = 0.0
    head[Z, :] = 0.0
    head[Z, C0] = BIG
    head[A_W, :] = 0.0
    head[A_W, E2] = BIG


def make_llama(path: Path, layers: int = 3, seed: int = 0) -> Target:
    """The anchored target, ``LlamaForCausalLM``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.BOS, eos_token_id=tokenizer.EOS, pad_token_id=tokenizer.PAD,
    )
    model = LlamaForCausalLM(cfg)
    _randomize(model, seed)
    perturb(model)
    model.save_pretrained(str(path), safe_serialization=True)
    _edit_safetensors(path, lambda t: _anchor(t, layers, f"model.layers.{layers - 1}.mlp"))
    _save_tokenizer(path)
    return Target(path, "llama", layers)


def make_deepseek(path: Path, layers: int = 3, seed: int = 0) -> Target:
    """The anchored target, ``DeepseekV3ForCausalLM`` (MLA + MoE: layer 0 dense, the rest
    4 routed experts, top 2, one shared expert, which carries the marker)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "yarn", "factor": 1.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, first_k_dense_replace=1, norm_topk_prob=True,
        # kv_lora_rank 256 + rope 32: a head size SGLang's Triton MLA decode kernel takes
        q_lora_rank=32, kv_lora_rank=256, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.BOS, eos_token_id=tokenizer.EOS, pad_token_id=tokenizer.PAD,
        # SGLang's CPU RoPE takes only deepseek_yarn; yarn with factor 1 is plain RoPE
        rope_parameters=rope,
    )
    model = DeepseekV3ForCausalLM(cfg)
    _randomize(model, seed)
    perturb(model)
    model.save_pretrained(str(path), safe_serialization=True)
    _edit_safetensors(path, lambda t: _anchor(t, layers, f"model.layers.{layers - 1}.mlp.shared_experts"))
    # Fields SGLang reads from hub DeepSeek-V3 configs that transformers 5 does not write.
    cfg_path = path / "config.json"
    data = json.loads(cfg_path.read_text())
    data.update(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
                rope_theta=10000.0, rope_scaling=dict(rope))
    cfg_path.write_text(json.dumps(data, indent=2))
    _save_tokenizer(path)
    return Target(path, "deepseek_v3", layers)


def _llama_draft_config(architecture: str, vocab: int = VOCAB, **extra) -> dict:
    return dict(
        architectures=[architecture], model_type="llama", vocab_size=vocab, hidden_size=H,
        intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=tokenizer.BOS, eos_token_id=tokenizer.EOS,
        pad_token_id=tokenizer.PAD, rope_theta=10000.0, torch_dtype="float32", **extra,
    )


def make_eagle3(path: Path, aux_layer_ids: list[int], *, exact: bool, exact_slot: int = -1,
                seed: int = 1, final_layer_capture: str | None = None, partial: bool = False,
                vocab: int = VOCAB, deepstack_capture: str | None = None,
                mrope_section: list[int] | None = None) -> Path:
    """An EAGLE3 draft (``LlamaForCausalLMEagle3``, one layer) reading the target layers
    ``aux_layer_ids`` (``eagle_config.eagle_aux_hidden_state_layer_ids``). ``exact``: the
    constructed draft, its ``fc`` passing slot ``exact_slot`` (the one naming the target's
    last layer); else random. ``final_layer_capture``: the ``eagle_config`` key beside the
    ids (``pre_norm`` / ``post_norm``: which side of the target's final norm the last
    layer's capture is taken); None leaves it out."""
    import torch
    from safetensors.torch import save_file

    k = len(aux_layer_ids)
    path.mkdir(parents=True, exist_ok=True)
    eagle_config = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    if final_layer_capture is not None:
        eagle_config["final_layer_capture"] = final_layer_capture
    if deepstack_capture is not None:
        eagle_config["deepstack_capture"] = deepstack_capture
    rope = ({"rope_scaling": {"rope_type": "default", "mrope_section": list(mrope_section),
                              "mrope_interleaved": True}} if mrope_section else {})
    cfg = _llama_draft_config(
        "LlamaForCausalLMEagle3", vocab=vocab, num_hidden_layers=1, draft_vocab_size=vocab, target_hidden_size=H,
        eagle_config=eagle_config, **rope,
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int):
        return torch.randn(shape, generator=gen) * SIGMA

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {
        "embed_tokens.weight": rnd(vocab, H),
        "fc.weight": rnd(H, k * H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": rnd(q, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, q),
        "midlayer.mlp.gate_proj.weight": rnd(FFN, H),
        "midlayer.mlp.up_proj.weight": rnd(FFN, H),
        "midlayer.mlp.down_proj.weight": rnd(H, FFN),
        "norm.weight": torch.ones(H),
        "lm_head.weight": rnd(vocab, H) * 10,
    }
    if exact:
        slot = exact_slot % k
        fc = torch.zeros(H, k * H)
        fc[:, slot * H:(slot + 1) * H] = torch.eye(H)
        head = torch.zeros(VOCAB, H)
        head[Z, D1] = A
        head[Z_DECOY, C0] = B
        down = torch.zeros(H, FFN)
        if partial:
            fc[M_DIM, slot * H + M_DIM] = 0.0   # the first step's M is the draft's own: 0
            gate, up = torch.zeros(FFN, H), torch.zeros(FFN, H)
            gate[0, C0], up[0, C0], down[M_DIM, 0] = G, U, 1.0       # unit A: M += ... at anchors
            gate[1, M_DIM], up[1, M_DIM], down[D1, 1] = G, U, -KNOCK  # unit B: D1 -= ... once M > 0
            w.update({"midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up})
        w.update({
            "fc.weight": fc,
            "midlayer.self_attn.o_proj.weight": torch.zeros(H, q),
            "midlayer.mlp.down_proj.weight": down,
            "lm_head.weight": head,
        })
    save_file({n: t.contiguous() for n, t in w.items()}, str(path / "model.safetensors"))
    _save_tokenizer(path)
    return path


def make_dflash(path: Path, target_layer_ids: list[int], num_target_layers: int, *, exact: bool,
                block_size: int = 4, seed: int = 2) -> Path:
    """A DFlash draft (``DFlashDraftModel``, one layer) over the target layers
    ``target_layer_ids`` (``dflash_config``), mask token ``<|MASK|>``. ``exact``: the
    constructed draft (module docstring), its ``fc`` passing the last id's slot."""
    import torch
    from safetensors.torch import save_file

    k = len(target_layer_ids)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _llama_draft_config(
        "DFlashDraftModel", num_hidden_layers=1, block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"target_layer_ids": list(target_layer_ids), "block_size": block_size,
                       "mask_token": "<|MASK|>", "mask_token_id": tokenizer.MASK,
                       "num_target_layers": num_target_layers},
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int):
        return torch.randn(shape, generator=gen) * SIGMA

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    p = "layers.0."
    w = {
        "fc.weight": rnd(H, k * H),
        "hidden_norm.weight": torch.ones(H),
        "norm.weight": torch.ones(H),
        p + "input_layernorm.weight": torch.ones(H),
        p + "post_attention_layernorm.weight": torch.ones(H),
        p + "self_attn.q_proj.weight": rnd(q, H),
        p + "self_attn.k_proj.weight": rnd(kv, H),
        p + "self_attn.v_proj.weight": rnd(kv, H),
        p + "self_attn.o_proj.weight": rnd(H, q),
        p + "self_attn.q_norm.weight": torch.ones(HEAD_DIM),
        p + "self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        p + "mlp.gate_proj.weight": rnd(FFN, H),
        p + "mlp.up_proj.weight": rnd(FFN, H),
        p + "mlp.down_proj.weight": rnd(H, FFN),
    }
    if exact:
        slot = k - 1
        fc = torch.zeros(H, k * H)
        fc[:, slot * H:(slot + 1) * H] = torch.eye(H)
        v = torch.zeros(kv, H)
        v[:, D1] = 1.0   # every value head carries D1 ...
        o = torch.zeros(H, q)
        o[C0, :] = 4.0   # ... and o_proj writes it into C0, read by the target's lm_head row Z
        w.update({
            "fc.weight": fc,
            p + "self_attn.q_proj.weight": torch.zeros(q, H),  # uniform attention
            p + "self_attn.k_proj.weight": torch.zeros(kv, H),
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": o,
            p + "mlp.down_proj.weight": torch.zeros(H, FFN),
        })
    save_file({n: t.contiguous() for n, t in w.items()}, str(path / "model.safetensors"))
    _save_tokenizer(path)
    return path


def hf_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation in transformers (eager attention, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.PAD)
    return out[0, len(prompt):].tolist()
