#!/usr/bin/env python3
"""Writes tests/golden/edit_qwenimage_zero_cond_t/: a whole QwenImageEditPlusPipeline run whose
transformer has `zero_cond_t: true` (Qwen-Image-Edit-2511's), made by diffusers and transformers
themselves. Run by hand, never by the test suite:

    python3 tests/golden/tools/make_qwenimage_edit_zero_cond_t_case.py --components build/tests/golden

It is make_qwenimage_edit_cases.py's pipeline run (its helpers, prompt, 48² VAE area, processor
and components) with other pins: diffusers 0.36.0, which made edit_qwenimage/, predates
`zero_cond_t`; 0.37.0 is the first release that has it. The case's folder links every component
of edit_qwenimage/ except the transformer's config.json (zero_cond_t: true; the option adds no
parameter, so the weights are the same link). Before writing, the script checks that 0.37.0's
pipeline with the edit_qwenimage/ transformer (zero_cond_t false) gives edit_qwenimage/'s run
`plus_two_cfg` (0.36.0's), so that the two cases differ by zero_cond_t alone. README.md beside it
says why these versions.
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_qwenimage_edit_cases as edit  # noqa: E402

PINNED = ["torch==2.15.0", "diffusers==0.37.0", "transformers==4.57.6", "huggingface_hub==0.36.2",
          "tokenizers==0.22.2", "pillow==13.0.0", "numpy==2.4.6", "safetensors==0.8.0"]

# Two images, true CFG, a non-square output: the noise grid then two reference grids.
RUN = ("plus_two_cfg_zero_cond_t", "QwenImageEditPlusPipeline", ["square", "tall"], 48, 32,
       edit.NEGATIVE_PROMPT, 4.0, 19)
# The edit_qwenimage/ run the same pipeline must reproduce with zero_cond_t false.
CROSS_CHECK = next(run for run in edit.PIPELINE_RUNS if run[0] == "plus_two_cfg")
# 0.36.0 vs 0.37.0 on the same run: the golden tolerance (fp32 1e-4 + 1e-4 |x|), and what
# was measured printed.
CROSS_CHECK_TOLERANCE = 1e-4


def write_folder(out, repo_golden):
    """Links to edit_qwenimage/'s components (to the files they link to, where they are links:
    the folders lie at the same depth) and source images; the transformer's config of its own."""
    source = os.path.join(repo_golden, "edit_qwenimage")
    for comp in ["text_encoder", "vae", "scheduler", "tokenizer", "processor", "transformer"]:
        for name in sorted(os.listdir(os.path.join(source, comp))):
            if comp == "transformer" and name == "config.json":
                continue
            path = os.path.join(source, comp, name)
            target = os.readlink(path) if os.path.islink(path) else os.path.join("..", "..", "edit_qwenimage", comp, name)
            edit.link(target, os.path.join(out, comp, name))
    for name in RUN[2]:
        edit.link(os.path.join("..", "edit_qwenimage", f"source_{name}.png"), os.path.join(out, f"source_{name}.png"))
    with open(os.path.join(source, "transformer", "config.json")) as f:
        config = json.load(f)
    config["zero_cond_t"] = True
    config["_diffusers_version"] = "0.37.0"
    path = os.path.join(out, "transformer", "config.json")
    if os.path.lexists(path):
        os.remove(path)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(source, "model_index.json")) as f:
        model_index = json.load(f)
    model_index["_diffusers_version"] = "0.37.0"
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(model_index, f, indent=2)
        f.write("\n")


def main():
    args = edit.parse_args(__doc__, "edit_qwenimage_zero_cond_t", "/tmp/shardit-golden-qwenimage-edit-zero-cond-t")
    edit.ensure_venv(args, PINNED)

    import torch
    import diffusers
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from PIL import Image
    from safetensors.torch import load_file

    assert diffusers.__version__ == "0.37.0", diffusers.__version__
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    write_folder(args.out, args.repo_golden)

    view = os.path.join(args.components, "edit_qwenimage")
    text_encoder, vae, tokenizer, processor = edit.load_conditioning(
        args.components, os.path.join(view, "processor", "preprocessor_config.json"))
    images = {name: Image.open(os.path.join(view, f"source_{name}.png")).convert("RGB") for name in RUN[2]}
    comp = os.path.join(args.components, "pipeline_qwenimage")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(comp, "scheduler"))
    edit.shrink_vae_area()

    def components(zero_cond_t):
        transformer = QwenImageTransformer2DModel.from_pretrained(
            os.path.join(comp, "transformer"), torch_dtype=torch.float32, zero_cond_t=zero_cond_t).eval()
        assert transformer.config.zero_cond_t == zero_cond_t
        return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                    processor=processor, transformer=transformer)

    scratch = tempfile.mkdtemp()  # the PNGs of the runs that are not stored
    tensors = {}
    with torch.no_grad():
        # 0.37.0 with the edit_qwenimage transformer must give 0.36.0's run.
        again = {}
        edit.run_pipeline(CROSS_CHECK, components(False), images, again, scratch)
        stored = load_file(os.path.join(view, "outputs.safetensors"))
        for name, value in again.items():
            expected = stored[name]
            excess = ((value - expected).abs() - CROSS_CHECK_TOLERANCE * (1 + expected.abs())).max().item()
            print(f"diffusers 0.37.0 vs 0.36.0 {name}: max |diff| {(value - expected).abs().max().item():.3e}")
            assert excess <= 0, f"{name}: diffusers 0.37.0 does not reproduce edit_qwenimage"

        run_components = components(True)
        case = {
            "producer": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                         "transformers": transformers.__version__,
                         "precision": "float32 on CPU, one thread, transformers eager attention"},
            "components": "links to edit_qwenimage/'s, except transformer/config.json: zero_cond_t true",
            "pipeline": edit.pipeline_section(),
        }
        case["pipeline"]["runs"].append(edit.run_pipeline(RUN, run_components, images, tensors, args.out))
        base = {}
        edit.run_pipeline(RUN, components(False), images, base, scratch)
        change = (tensors[f"{RUN[0]}.image"] - base[f"{RUN[0]}.image"]).abs().max().item()
        print(f"zero_cond_t true vs false, {RUN[0]}.image: max |diff| {change:.3e}")
        case["pipeline"]["zero_cond_t_changes_image_by"] = change

    edit.write_case(args.out, tensors, case)


if __name__ == "__main__":
    main()
