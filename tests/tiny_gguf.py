"""Write a tiny, randomly initialised qwen2 model as a GGUF file (no download).

It borrows the embedded model's tokenizer (a GPT-2 style BPE, stored in its GGUF
metadata), so the file exercises the loader's GGUF path on a second architecture:
biases on q/k/v, a separate LM head, different head counts.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"]


def write_tiny_qwen2_gguf(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          ffn: int = 128, seed: int = 0) -> Path:
    import gguf

    from course_utils.models import embedded_gguf_path

    source = gguf.GGUFReader(str(embedded_gguf_path()))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2-random")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    for key in TOKENIZER_KEYS:
        field = source.fields[key]
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    writer.add_tensor("token_embd.weight", w(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", w(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_q.bias", w(heads * head_dim))
        writer.add_tensor(p + "attn_k.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.bias", w(kv_heads * head_dim))
        writer.add_tensor(p + "attn_v.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.bias", w(kv_heads * head_dim))
        writer.add_tensor(p + "attn_output.weight", w(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", w(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", w(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", w(hidden, ffn))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", w(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    import sys
    print(write_tiny_qwen2_gguf(Path(sys.argv[1])))
