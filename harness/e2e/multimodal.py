"""Tiny processors for the multimodal families, so SGLang's real Engine serves them on
the CPU with images (the return-aux tier, ``harness.e2e.features``).

SGLang 0.5.23's tokenizer manager loads the model's processor when the Engine starts,
``skip_tokenizer_init`` or not (``managers/tokenizer_manager.py:612-616``), and a tiny
checkpoint has none. :func:`save_processor` writes one beside it with
``save_pretrained``, for the families' tiny configs (vocabulary 160, special tokens
inside it):

* Qwen3-VL and Qwen3.5 (``Qwen3VLProcessor``, which ``AutoProcessor`` also maps
  qwen3_5 to): a word-level tokenizer (``w<i>`` for id ``i``, Qwen's special tokens at
  the config's ids), ``Qwen2VLImageProcessor`` and ``Qwen3VLVideoProcessor`` with the
  tiny tower's patch 4, temporal patch 2 and merge 2: a 16 x 16 image is a grid of
  1 x 4 x 4 patches, 4 image tokens;
* Gemma 4 (``Gemma4Processor``): the same tokenizer with Gemma 4's named special tokens
  (image, its begin and end, video, audio and the audio's begin and end, which its
  input validation requires) at the family's ids, ``Gemma4ImageProcessor`` with patch 4,
  pooling 2 and the smallest ``max_soft_tokens`` it takes (70).

A request carries its image as one placeholder in the token ids (Qwen:
``<|vision_start|> <|image_pad|> <|vision_end|>``; Gemma 4: ``<|image> <|image|>
<image|>``), which SGLang expands to the image's token count
(``multimodal/processors/base_processor.py`` ``_expand_input_ids``); transformers gets
the same sequence from the saved processor itself (:func:`hf_inputs`: the expanded ids,
``pixel_values`` and the rest of what the processor returns).

Stdlib-only at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

VOCAB = 160
# Qwen3-VL's special tokens in the tiny vocabulary, and its tiny tower: 3 blocks, each
# feeding deepstack into one of decoder layers 0-2 (the return-aux tier's and the doctor's
# checkpoints).
VL_TOKENS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
VL_VISION = dict(depth=3, deepstack_visual_indexes=[0, 1, 2])
# Qwen's special tokens: the ids VL_TOKENS (Qwen3-VL) and the return-aux tier's Qwen3.5
# config put in the vocabulary.
QWEN_SPECIAL = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 150: "<|image_pad|>",
                151: "<|video_pad|>", 152: "<|vision_start|>", 153: "<|vision_end|>"}
QWEN_IMAGE = (152, 150, 153)    # the placeholder of one image in a prompt
# Gemma 4's (the parity family's ids, harness/parity/families/gemma.py).
GEMMA4_NAMED = {"image_token": ("<|image|>", 152), "boi_token": ("<|image>", 150),
                "eoi_token": ("<image|>", 151), "video_token": ("<|video|>", 154),
                "audio_token": ("<|audio|>", 157), "boa_token": ("<|audio>", 155),
                "eoa_token": ("<audio|>", 156)}
GEMMA4_SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", **{i: s for s, i in GEMMA4_NAMED.values()}}
GEMMA4_IMAGE = (150, 152, 151)
IMAGE_SIZE = (16, 16)


def kind(family: str) -> str:
    if family.startswith(("qwen3_vl", "qwen3_5")):
        return "qwen"
    if family.startswith("gemma4"):
        return "gemma4"
    raise ValueError(f"{family}: no tiny processor (qwen3_vl*, qwen3_5*, gemma4*)")


def placeholder(family: str) -> tuple[int, ...]:
    return QWEN_IMAGE if kind(family) == "qwen" else GEMMA4_IMAGE


def _tokenizer(special: dict[int, str], **kwargs: Any):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    # Special tokens split out before the whitespace split: a placeholder written
    # without spaces is still its three tokens.
    tok.add_special_tokens([AddedToken(special[i], special=True, normalized=False) for i in sorted(special)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    for i, s in special.items():
        if fast.convert_tokens_to_ids(s) != i:
            raise RuntimeError(f"tiny tokenizer: {s} is {fast.convert_tokens_to_ids(s)}, not {i}")
    return fast


def _qwen_processor():
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    patch, temporal, merge = 4, 2, 2
    side = patch * merge
    # shortest_edge / longest_edge: the least and most pixels; a 16 x 16 image stays as it is.
    tokenizer = _tokenizer(QWEN_SPECIAL, eos_token=QWEN_SPECIAL[2], pad_token=QWEN_SPECIAL[0],
                           extra_special_tokens=[QWEN_SPECIAL[i] for i in (1, 150, 151, 152, 153)])
    image = Qwen2VLImageProcessor(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                  size={"shortest_edge": side * side, "longest_edge": 64 * 64})
    video = Qwen3VLVideoProcessor(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                                  size={"shortest_edge": side * side, "longest_edge": 4 * 64 * 64})
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video)


def _gemma4_processor():
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    patch, pool, soft = 4, 2, 70  # max_soft_tokens: one of 70, 140, 280, 560, 1120
    tokenizer = _tokenizer(GEMMA4_SPECIAL, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                           extra_special_tokens={k: s for k, (s, _) in GEMMA4_NAMED.items()})
    image = Gemma4ImageProcessor(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=soft)
    video = Gemma4VideoProcessor(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=soft)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image,
                           tokenizer=tokenizer, video_processor=video, image_seq_length=soft)


def save_processor(family: str, directory: Path) -> None:
    """The family's tiny processor, saved beside its checkpoint in ``directory``."""
    processor = _qwen_processor() if kind(family) == "qwen" else _gemma4_processor()
    processor.save_pretrained(str(directory))


def save_image(path: Path, seed: int = 0, size: Sequence[int] = IMAGE_SIZE) -> Path:
    """A seeded RGB image of ``size`` (width, height), as a PNG."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def hf_inputs(directory: Path, prompt: Sequence[int], image: Path) -> dict[str, Any]:
    """What transformers takes for ``prompt`` (token ids with one image placeholder) and
    ``image``: the saved processor's image processor output for the image
    (``pixel_values`` and the rest), and the prompt with its image token repeated as
    many times as the image has tokens (Qwen: its grid's patches over the merge's;
    Gemma 4: its soft tokens), as the processor and SGLang expand it, with the
    ``mm_token_type_ids`` of that sequence (1 on image tokens). The ids are expanded
    here, not by the processor's tokenizer: ``AutoProcessor`` gives a qwen3_5 checkpoint
    transformers' own Qwen3.5 tokenizer, which does not know the tiny vocabulary."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(directory))
    enc = dict(processor.image_processor(images=[Image.open(image).convert("RGB")], return_tensors="pt"))
    if "image_grid_thw" in enc:  # Qwen
        merge = int(processor.image_processor.merge_size)
        count, image_id = int(enc["image_grid_thw"][0].prod()) // (merge * merge), QWEN_IMAGE[1]
    else:  # Gemma 4
        count, image_id = int(enc.pop("num_soft_tokens_per_image")[0]), GEMMA4_IMAGE[1]
    if list(prompt).count(image_id) != 1:
        raise ValueError(f"a prompt with one image placeholder, not {list(prompt).count(image_id)}")
    ids = [t for x in prompt for t in ([x] * count if x == image_id else [x])]
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "mm_token_type_ids": (input_ids == image_id).int(), **enc}
