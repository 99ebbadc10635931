#!/usr/bin/env python3
"""Writes the golden case `qwenimage_edit_zero_cond_t_b2` with diffusers itself.

Qwen-Image-Edit-2511's transformer is QwenImageTransformer2DModel with `zero_cond_t: true`: the
first (frame, height, width) grid of img_shapes holds the noise tokens, the others the reference
images' tokens, and the reference tokens are modulated with the embedding of timestep 0. The
option adds no parameters, so the case reuses the weights of `qwenimage_b1_square` (a link) with
its config turned to zero_cond_t, and calls the transformer on a batch of two samples whose image
tokens are a noise grid followed by two reference grids of other sizes (29 tokens: an odd count,
so context-parallel splits are uneven), with a padded text mask on the second sample.

Run by hand, never by the suite (it needs PyPI's torch and diffusers at the versions the
benchmarks' yardstick pins, bench/yardstick_venv.sh):

    python3 tests/golden/tools/make_qwenimage_zero_cond_t_case.py --venv build/yardstick-venv \
        --golden-view build/tests/golden --out tests/golden

When the running Python lacks those versions it makes the virtual environment with
bench/yardstick_venv.sh and runs itself there. `--golden-view` is the build folder's unpacked view of tests/golden (configure makes
it), from which the weights are read. Everything runs in float32 on the CPU with one thread.
"""
import argparse
import json
import os
import subprocess
import sys

TORCH_VERSION = "2.15.0"  # bench/yardstick_venv.sh's pins
DIFFUSERS_VERSION = "0.42.1"
CASE = "qwenimage_edit_zero_cond_t_b2"
WEIGHTS_CASE = "qwenimage_b1_square"
SEED = 20261206
IMG_SHAPES = [(1, 3, 5), (1, 2, 3), (1, 4, 2)]  # noise grid, then two reference grids
BATCH = 2
TEXT_LEN = 7
TIMESTEPS = [0.875, 0.3125]
MASK = [[1] * 7, [1] * 5 + [0] * 2]


def pinned_versions_present():
    try:
        import diffusers
        import torch
    except ImportError:
        return False
    return torch.__version__.split("+")[0] == TORCH_VERSION and diffusers.__version__ == DIFFUSERS_VERSION


def ensure_environment(venv):
    if pinned_versions_present():
        return
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
    subprocess.check_call(["bash", os.path.join(root, "bench", "yardstick_venv.sh"), os.path.abspath(venv)])
    python = os.path.join(venv, "bin", "python")
    os.execv(python, [python, *sys.argv])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--golden-view", required=True, help="the build folder's tests/golden (unpacked)")
    parser.add_argument("--out", required=True, help="tests/golden of the source tree")
    args = parser.parse_args()
    ensure_environment(args.venv)

    import diffusers
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    config = json.load(open(os.path.join(args.golden_view, WEIGHTS_CASE, "config.json")))
    config["zero_cond_t"] = True
    config["_diffusers_version"] = diffusers.__version__
    model_config = {k: v for k, v in config.items() if not k.startswith("_")}
    model = diffusers.QwenImageTransformer2DModel(**model_config)
    state = load_file(os.path.join(args.golden_view, WEIGHTS_CASE, "diffusion_pytorch_model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    model.eval()

    tokens = sum(f * h * w for f, h, w in IMG_SHAPES)
    generator = torch.Generator().manual_seed(SEED)
    inputs = {
        "hidden_states": torch.randn(BATCH, tokens, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, config["joint_attention_dim"], generator=generator),
        "encoder_hidden_states_mask": torch.tensor(MASK, dtype=torch.int64),
        "timestep": torch.tensor(TIMESTEPS, dtype=torch.float32),
    }
    img_shapes = [list(IMG_SHAPES)] * BATCH

    recorded = {}

    def keep(name):
        def hook(_module, _inputs, output):
            recorded[name] = output.detach().clone()
        return hook

    model.img_in.register_forward_hook(keep("img_in"))
    model.txt_norm.register_forward_hook(keep("txt_norm"))
    model.txt_in.register_forward_hook(keep("txt_in"))
    model.time_text_embed.register_forward_hook(keep("temb"))
    model.time_text_embed.time_proj.register_forward_hook(keep("temb.timestep_proj"))
    model.time_text_embed.timestep_embedder.register_forward_hook(keep("temb.timestep_emb"))
    model.norm_out.register_forward_hook(keep("norm_out"))
    model.norm_out.linear.register_forward_hook(keep("norm_out.linear"))

    def rope_hook(_module, _inputs, output):
        image, text = output
        recorded["rope.img.real"], recorded["rope.img.imag"] = image.real.clone(), image.imag.clone()
        recorded["rope.txt.real"], recorded["rope.txt.imag"] = text.real.clone(), text.imag.clone()
    model.pos_embed.register_forward_hook(rope_hook)

    for index, block in enumerate(model.transformer_blocks):
        def block_hook(_module, _inputs, output, index=index):
            encoder_hidden_states, hidden_states = output
            recorded[f"block.transformer_blocks.{index}.encoder_hidden_states"] = encoder_hidden_states.clone()
            recorded[f"block.transformer_blocks.{index}.hidden_states"] = hidden_states.clone()
        block.register_forward_hook(block_hook)
    first = model.transformer_blocks[0]
    first.img_mod.register_forward_hook(keep("debug.transformer_blocks.0.img_mod"))
    first.txt_mod.register_forward_hook(keep("debug.transformer_blocks.0.txt_mod"))
    first.img_mlp.register_forward_hook(keep("debug.transformer_blocks.0.img_mlp"))
    first.txt_mlp.register_forward_hook(keep("debug.transformer_blocks.0.txt_mlp"))

    def attn_hook(_module, _inputs, output):
        recorded["debug.transformer_blocks.0.attn.hidden_states"] = output[0].clone()
        recorded["debug.transformer_blocks.0.attn.encoder_hidden_states"] = output[1].clone()
    first.attn.register_forward_hook(attn_hook)

    with torch.no_grad():
        (sample,) = model(**inputs, img_shapes=img_shapes, return_dict=False)
    recorded["sample"] = sample

    out = os.path.join(args.out, CASE)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(out, "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in recorded.items()}, os.path.join(out, "outputs.safetensors"))
    spec = {
        "model_class": "QwenImageTransformer2DModel",
        "variant": "zero_cond_t (Qwen-Image-Edit-2511): noise grid then two reference grids, text mask padded",
        "call": "QwenImageTransformer2DModel.forward(**inputs.safetensors tensors, **non_tensor_kwargs)",
        "non_tensor_kwargs": {"img_shapes": img_shapes, "return_dict": False},
        "weights": f"../{WEIGHTS_CASE}/diffusion_pytorch_model.safetensors (zero_cond_t adds no parameters)",
        "seed": SEED,
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
        "notes": [
            "timestep is t/1000 as the pipeline passes it; with zero_cond_t the model appends a zero timestep per "
            "sample, so temb is [2B, D] and img_mod [2B, 6D].",
            "modulate_index: the first grid's tokens take the sample's timestep, the reference grids' tokens timestep 0.",
        ],
    }
    with open(os.path.join(out, "inputs.json"), "w") as f:
        json.dump(spec, f, indent=2)
        f.write("\n")
    print(f"wrote {out}: {len(recorded)} tensors, sample {tuple(sample.shape)}")


if __name__ == "__main__":
    main()
