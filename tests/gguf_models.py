"""A tiny Llama written as a GGUF file with the `gguf` package, the way llama.cpp's
converter lays one out: llama hyperparameters, a byte-level BPE ("gpt2") vocabulary with
ChatML special tokens and a chat template, and float32 tensors under GGUF names.

Used by tests/workload/test_realmodel.py to run the real GGUF -> safetensors conversion (the path
`--model smollm2` takes) in seconds, with nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 32, 2, 2, 1, 16, 64, 2048


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies spell)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_tensors(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of a 2-layer Llama ([out, in] like torch's Linear)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, HIDDEN), "output_norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        tensors.update(
            {
                f"blk.{i}.attn_norm.weight": 1 + w(HIDDEN),
                f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
                f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
                f"blk.{i}.ffn_norm.weight": 1 + w(HIDDEN),
                f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
                f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
                f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
            }
        )
    return tensors


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the tiny model to `path`; return its tensors (by GGUF name)."""
    import gguf

    merged = [m.replace(" ", "") for m in MERGES]
    tokens = byte_symbols() + list(dict.fromkeys(merged)) + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    types += [gguf.TokenType.CONTROL] * len(SPECIALS)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvstrata tiny gguf")
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHATML)
    tensors = tiny_tensors(len(tokens), seed)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors
