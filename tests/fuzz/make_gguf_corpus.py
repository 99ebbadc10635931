#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_gguf_header (corpus_gguf/): small whole GGUF files, valid ones
covering every metadata value type and several tensor types, and broken ones for each refusal.
Plain struct packing, no gguf-py: the seeds must not depend on a package being installed."""
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_gguf")

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
          U64: "<Q", I64: "<q", F64: "<d"}
# ggml type: (block elements, block bytes)
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144), 14: (256, 210), 30: (1, 2)}


def string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def value(kind, item):
    if kind == STRING:
        return string(item)
    if kind == ARRAY:
        element_kind, items = item
        return struct.pack("<IQ", element_kind, len(items)) + b"".join(value(element_kind, x) for x in items)
    return struct.pack(SCALAR[kind], item)


def gguf(metadata, tensors, version=3, alignment=32, data=None, magic=b"GGUF", tensor_count=None):
    """metadata: [(key, kind, item)]; tensors: [(name, dims (ggml order), ggml type, offset)]."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count, len(metadata))
    for key, kind, item in metadata:
        out += string(key) + struct.pack("<I", kind) + value(kind, item)
    end = 0
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, offset)
        block, size = BLOCKS.get(kind, (1, 1))
        rows = 1
        for d in dims[1:]:
            rows *= d
        end = max(end, offset + rows * dims[0] // block * size)
    out += b"\0" * (-len(out) % alignment)
    return out + (bytes((i * 37) & 0xFF for i in range(end)) if data is None else data)


def write(name, content):
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(content)


def main():
    os.makedirs(HERE, exist_ok=True)
    every_type = [("general.architecture", STRING, "flux"), ("u8", U8, 7), ("i8", I8, -7), ("u16", U16, 700),
                  ("i16", I16, -700), ("u32", U32, 70000), ("i32", I32, -70000), ("f32", F32, 0.5),
                  ("bool", BOOL, True), ("u64", U64, 2**40), ("i64", I64, -2**40), ("f64", F64, 0.25),
                  ("strings", ARRAY, (STRING, ["a", "bc", ""])), ("ints", ARRAY, (I32, [1, -2, 3])),
                  ("nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["x"])]))]
    write("valid_metadata_types", gguf(every_type, [("w", [4, 2], 0, 0)]))
    write("valid_quantized", gguf([("general.alignment", U32, 64)],
                                  [("a.weight", [32, 3], 2, 0), ("b.weight", [256, 1], 12, 128),
                                   ("c.weight", [256, 2], 14, 320), ("d.bias", [5], 30, 768),
                                   ("e.weight", [64, 1], 8, 832)], alignment=64))
    write("valid_v2_no_tensors", gguf([("general.name", STRING, "empty")], [], version=2))
    write("valid_f16_3d", gguf([], [("x", [2, 3, 2], 1, 0)]))
    write("bad_magic", gguf([], [], magic=b"GGUG"))
    write("bad_version_1", gguf([], [], version=1))
    write("bad_big_endian", gguf([], [], version=0x03000000))
    write("bad_duplicate_tensor", gguf([], [("w", [4], 0, 0), ("w", [4], 0, 32)]))
    write("bad_duplicate_key", gguf([("k", U8, 1), ("k", U8, 2)], []))
    write("bad_unknown_type", gguf([], [("w", [4], 99, 0)]))
    write("bad_block_multiple", gguf([], [("w", [48, 2], 2, 0)]))
    write("bad_past_end", gguf([], [("w", [64, 4], 0, 0)], data=b"\0" * 64))
    write("bad_misaligned", gguf([], [("w", [4], 0, 0), ("v", [4], 0, 20)]))
    write("bad_overlap", gguf([], [("w", [16], 0, 0), ("v", [16], 0, 32)]))
    write("bad_string_length", gguf([("k", STRING, "abc")], [])[:-3] + struct.pack("<Q", 2**62))
    write("bad_array_count", gguf([("k", ARRAY, (U32, []))], []).replace(
        struct.pack("<IQ", U32, 0), struct.pack("<IQ", U32, 2**61)))
    write("bad_tensor_count", gguf([], [], tensor_count=2**60))
    write("bad_alignment", gguf([("general.alignment", U32, 48)], [("w", [4], 0, 0)]))
    write("bad_dims", gguf([], [("w", [4, 1, 1, 1, 1], 0, 0)]))
    write("bad_dim_overflow", gguf([], [("w", [2**40, 2**40], 0, 0)], data=b""))
    write("bad_nested_depth", gguf([("deep", ARRAY, (ARRAY, [(ARRAY, [(ARRAY, [(ARRAY, [(ARRAY, [
        (ARRAY, [(ARRAY, [(ARRAY, [(U8, [1])])])])])])])])]))], []))


if __name__ == "__main__":
    main()
