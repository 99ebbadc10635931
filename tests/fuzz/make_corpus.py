#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_safetensors_header: 8 bytes of data-section size, then a header."""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(name, data_size, header):
    if not isinstance(header, bytes):
        header = header.encode()
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(struct.pack("<Q", data_size) + header)


def main():
    os.makedirs(HERE, exist_ok=True)
    write("valid_two_tensors", 64, json.dumps({
        "__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
        "a.bias": {"dtype": "BF16", "shape": [16], "data_offsets": [32, 64]}}))
    sizes = [("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("I32", 4), ("I16", 2),
             ("I8", 1), ("U8", 1), ("BOOL", 1), ("F8_E4M3", 1), ("F8_E5M2", 1)]
    header, offset = {}, 0
    for name, size in sizes:
        header[name] = {"dtype": name, "shape": [1], "data_offsets": [offset, offset + size]}
        offset += size
    write("valid_all_dtypes", offset, json.dumps(header))
    write("valid_empty", 0, "{}")
    write("valid_scalar_and_empty_tensor", 4,
          '{"s":{"dtype":"I32","shape":[],"data_offsets":[0,4]},'
          '"e":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]}}        ')
    write("bad_overlap", 24, '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                             '"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}')
    write("bad_dtype", 4, '{"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}}')
    write("bad_negative_dim", 0, '{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}')
    write("bad_size", 48, '{"a":{"dtype":"F32","shape":[3,4],"data_offsets":[0,24]}}')
    write("bad_overflow", 0, '{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}')
    write("bad_metadata", 0, '{"__metadata__":{"k":[1,{"x":null}]}}')
    write("bad_json", 0, '{"a": {"dtype": "F32", "shape": [1e400], ')
    write("bad_duplicate", 2, '{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                              '"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    write("bad_nested", 0, "[" * 50 + "]" * 50)


if __name__ == "__main__":
    main()
