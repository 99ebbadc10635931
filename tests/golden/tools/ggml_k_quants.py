"""Q4_K, Q5_K and Q6_K blocks from float32 values, for test files: gguf-py 0.19.0 dequantizes these
types but has no quantizer for them (gguf.quants raises NotImplementedError).

The block layouts are the ggml format's, as gguf.quants' dequantizers read them (super-blocks of 256
values). The choice of scales is a plain one, not ggml's search for the best scales: each sub-block's
range maps onto the codes, and the sub-block scales are rounded onto the super-block's 6-bit (Q4_K,
Q5_K) or 8-bit (Q6_K) grid. The codes are valid blocks either way; the values a reader must compute
are gguf-py's dequantization of them, never the float32 input. `roundtrip_error` lets a writer check
the packing against gguf-py before it uses the blocks.
"""
import numpy as np

QK_K = 256


def _fp16(values):
    """values rounded to fp16 (as stored) and back to float32."""
    return values.astype(np.float16).astype(np.float32)


def _blocks(values):
    values = np.ascontiguousarray(values, dtype=np.float32)
    assert values.shape[-1] % QK_K == 0, "rows must be whole super-blocks of %d values" % QK_K
    return values.reshape(-1, QK_K)


def _scale_min_codes(values, levels):
    """For [n, 8, 32] values: the super-block's fp16 d and dmin ([n, 1] each), the 6-bit sub-block
    scale and min codes ([n, 8] uint8) and the codes q in [0, levels] ([n, 8, 32]) with
    value ~= d * scale * q - dmin * min."""
    low = np.minimum(values.min(axis=-1), 0.0)  # [n, 8]: a min code subtracts, so it is >= 0
    high = values.max(axis=-1)
    step = (high - low) / levels  # [n, 8]
    d = _fp16(step.max(axis=-1, keepdims=True) / 63.0)  # [n, 1]
    dmin = _fp16((-low).max(axis=-1, keepdims=True) / 63.0)
    scale = np.where(d > 0, np.clip(np.rint(step / np.where(d > 0, d, 1)), 0, 63), 0).astype(np.uint8)
    minimum = np.where(dmin > 0, np.clip(np.rint(-low / np.where(dmin > 0, dmin, 1)), 0, 63), 0).astype(np.uint8)
    unit = (d * scale)[..., None]  # [n, 8, 1]
    offset = (dmin * minimum)[..., None]
    q = np.where(unit > 0, np.clip(np.rint((values + offset) / np.where(unit > 0, unit, 1)), 0, levels), 0)
    return d, dmin, scale, minimum, q.astype(np.uint8)


def _pack_scale_min(scale, minimum):
    """Eight 6-bit scales and mins ([n, 8] each) in the 12 bytes of Q4_K/Q5_K: bytes 0-3 hold scales
    0-3 with the top bits of scales 4-7, bytes 4-7 mins 0-3 with the top bits of mins 4-7, bytes 8-11
    the low nibbles of scales 4-7 and (high nibble) mins 4-7."""
    packed = np.empty((scale.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (scale[:, 0:4] & 0x3F) | ((scale[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (minimum[:, 0:4] & 0x3F) | ((minimum[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (scale[:, 4:8] & 0x0F) | ((minimum[:, 4:8] & 0x0F) << 4)
    return packed


def _low_nibbles(q):
    """[n, 8, 32] codes: 128 bytes, sub-blocks 2c and 2c+1 in the low and high nibbles of bytes
    32c .. 32c+31."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(-1, 128)


def quantize_q4_k(values):
    """[..., k*256] float32 -> [rows, k*144] uint8 Q4_K blocks (d, dmin, scales, 4-bit codes)."""
    blocks = _blocks(values).reshape(-1, 8, 32)
    d, dmin, scale, minimum, q = _scale_min_codes(blocks, 15)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                          _pack_scale_min(scale, minimum), _low_nibbles(q)], axis=-1)
    return out.reshape(*np.shape(values)[:-1], -1)


def quantize_q5_k(values):
    """[..., k*256] float32 -> [rows, k*176] uint8 Q5_K blocks: Q4_K's with each code's fifth bit in
    qh (bit s of byte l: sub-block s, value l)."""
    blocks = _blocks(values).reshape(-1, 8, 32)
    d, dmin, scale, minimum, q = _scale_min_codes(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s, :] << s
    out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                          _pack_scale_min(scale, minimum), qh, _low_nibbles(q)], axis=-1)
    return out.reshape(*np.shape(values)[:-1], -1)


def quantize_q6_k(values):
    """[..., k*256] float32 -> [rows, k*210] uint8 Q6_K blocks: 6-bit codes (q - 32) in ql (low 4
    bits) and qh (high 2 bits), sixteen int8 scales of 16 values, the fp16 d last."""
    blocks = _blocks(values).reshape(-1, 16, 16)
    n = blocks.shape[0]
    step = np.abs(blocks).max(axis=-1) / 31.0  # [n, 16]
    d = _fp16(step.max(axis=-1, keepdims=True) / 127.0)  # [n, 1]
    scale = np.where(d > 0, np.clip(np.rint(step / np.where(d > 0, d, 1)), 0, 127), 0).astype(np.int8)
    unit = (d * scale.astype(np.float32))[..., None]
    q = np.where(unit > 0, np.clip(np.rint(blocks / np.where(unit > 0, unit, 1)), -32, 31), 0)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, group, value]: value 128h + 32g + l
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [n, 2, 32]
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scale.view(np.uint8),
                          d.astype(np.float16).view(np.uint8)], axis=-1)
    return out.reshape(*np.shape(values)[:-1], -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def roundtrip_error(values, codes, qtype):
    """max |gguf-py's dequantization of `codes` - values| / max |values|."""
    import gguf
    restored = gguf.quants.dequantize(codes, qtype).reshape(np.shape(values))
    return float(np.abs(restored - values).max() / max(np.abs(values).max(), 1e-30))
