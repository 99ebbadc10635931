#!/usr/bin/env python3
"""Writes tests/golden/edit_qwenimage/: golden data for Qwen-Image editing, made by diffusers and
transformers themselves. Run by hand, never by the test suite:

    python3 tests/golden/tools/make_qwenimage_edit_cases.py --components build/tests/golden

`--components` is an unpacked view of the golden set (the build folder's tests/golden): the tiny
random-weight Qwen-Image components of pipeline_qwenimage/ (Qwen2.5-VL text encoder with its
vision tower, AutoencoderKLQwenImage with its encoder, the transformer, the scheduler) and the
reduced Qwen tokenizer of pipeline_flux2_klein/ are reused, so the new case stores no weights.
The script creates a virtual environment (`--venv`), installs the pinned packages below into it
(torch from `--wheels` when given) and runs itself there. See README.md beside it for the versions
and why.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

PINNED = ["torch==2.15.0", "diffusers==0.36.0", "transformers==4.57.6", "huggingface_hub==0.36.2",
          "tokenizers==0.22.2", "pillow==13.0.0", "numpy==2.4.6", "safetensors==0.8.0"]

# The processor's pixel bounds for the tiny cases: small enough that every image is a few dozen
# patches (the data stays small), large enough that a 2:1 image spans two attention windows.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 20

PROMPT = "Put the red cube on the blue table, keep the lighting"
# (name, width, height) of the source images; drawn by `make_image`.
SOURCES = [("wide", 96, 48), ("square", 64, 64), ("tall", 45, 60), ("tiny", 20, 30), ("big", 500, 220),
           ("thin", 300, 40)]
# Images straight through the processor (Qwen2VLProcessor's image processor).
PROCESSOR_CASES = ["wide", "square", "tall", "tiny", "big", "thin"]
# encode_prompt with 1, 2 and 3 images, as QwenImageEditPlusPipeline.__call__ prepares them.
ENCODER_CASES = {"one": ["wide"], "two": ["square", "tall"], "three": ["tall", "wide", "big"]}
# _encode_vae_image on images preprocessed to these sizes (height, width).
VAE_CASES = {"wide": (32, 48), "tall": (48, 32)}

# Whole pipeline calls. The pipelines' 1024² area (the VAE images and the default output size) is
# VAE_AREA here so that every image is a few latent tokens; the condition area stays 384² (the
# processor's max_pixels bounds it anyway). (tag, class, images, height, width, negative prompt,
# true_cfg_scale, seed): height/width None take the output size from the last image, as diffusers.
VAE_AREA = 48 * 48
NEGATIVE_PROMPT = "blurry, low quality"
STEPS = 2
PIPELINE_RUNS = [
    ("plus_one", "QwenImageEditPlusPipeline", ["wide"], 32, 32, None, 1.0, 11),
    ("plus_two", "QwenImageEditPlusPipeline", ["square", "tall"], 48, 32, None, 1.0, 12),
    ("plus_three", "QwenImageEditPlusPipeline", ["tall", "wide", "big"], None, None, None, 1.0, 13),
    ("plus_one_cfg", "QwenImageEditPlusPipeline", ["wide"], 32, 32, NEGATIVE_PROMPT, 4.0, 14),
    ("plus_two_cfg", "QwenImageEditPlusPipeline", ["square", "tall"], 32, 32, NEGATIVE_PROMPT, 4.0, 15),
    ("plus_three_cfg", "QwenImageEditPlusPipeline", ["tall", "wide", "big"], 32, 32, NEGATIVE_PROMPT, 4.0, 16),
    ("edit_one", "QwenImageEditPipeline", ["tall"], None, None, None, 1.0, 17),
    ("edit_one_cfg", "QwenImageEditPipeline", ["wide"], 32, 32, NEGATIVE_PROMPT, 4.0, 18),
]


def ensure_venv(args, pinned=PINNED):
    if os.environ.get("SHARDIT_GOLDEN_VENV") == "1":
        return
    python = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.check_call([sys.executable, "-m", "venv", args.venv])
    pip = [python, "-m", "pip", "install", "-q"]
    if args.wheels:
        pip += ["--find-links", args.wheels]
    subprocess.check_call(pip + pinned)
    env = dict(os.environ, SHARDIT_GOLDEN_VENV="1")
    os.execve(python, [python] + sys.argv, env)


def make_image(width, height, seed):
    """A smooth gradient with a few flat rectangles: deterministic, and small as PNG."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    img = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                    127 + 100 * np.sin((x + y) / 7.0)], axis=-1)
    for _ in range(4):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        img[y0:y0 + height // 3 + 1, x0:x0 + width // 3 + 1] = rng.integers(0, 256, size=3)
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")


def sha256(array):
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(array).astype("<f4").tobytes()).hexdigest()


def processor_image(image_processor, image):
    """The uint8 image the processor normalizes (Image.resize BICUBIC to smart_resize's size, as
    transformers' resize does it), checked to give the processor's pixel_values exactly."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = image_processor
    w, h = image.size
    rh, rw = smart_resize(h, w, factor=ip.patch_size * ip.merge_size, min_pixels=ip.min_pixels,
                          max_pixels=ip.max_pixels)
    resized = np.array(image.convert("RGB").resize((rw, rh), resample=Image.BICUBIC))
    expected = ip(images=[image], return_tensors="np")["pixel_values"]
    again = ip(images=[Image.fromarray(resized)], return_tensors="np", do_resize=False)["pixel_values"]
    assert np.array_equal(again, expected), "the resized image does not give the processor's pixel_values"
    return resized


def link(src_rel, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.lexists(dst):
        os.remove(dst)
    os.symlink(src_rel, dst)


def write_folder(args):
    """The case's model folders: links to the pipeline_qwenimage components and the reduced
    tokenizer (so the repository stores each file once), and the processor's config."""
    out = args.out
    for comp in ["text_encoder", "vae", "transformer", "scheduler"]:
        src_dir = os.path.join(args.repo_golden, "pipeline_qwenimage", comp)
        for name in sorted(os.listdir(src_dir)):
            link(os.path.join("..", "..", "pipeline_qwenimage", comp, name), os.path.join(out, comp, name))
    tok_dir = os.path.join(args.repo_golden, "pipeline_flux2_klein", "tokenizer")
    for sub in ["tokenizer", "processor"]:
        for name in sorted(os.listdir(tok_dir)):
            link(os.path.join("..", "..", "pipeline_flux2_klein", "tokenizer", name), os.path.join(out, sub, name))
    processor_config = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": MAX_PIXELS, "merge_size": 2,
        "min_pixels": MIN_PIXELS, "patch_size": 14, "processor_class": "Qwen2VLProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": 2,
    }
    with open(os.path.join(out, "processor", "preprocessor_config.json"), "w") as f:
        json.dump(processor_config, f, indent=2, sort_keys=True)
        f.write("\n")
    model_index = {
        "_class_name": "QwenImageEditPlusPipeline", "_diffusers_version": "0.36.0",
        "processor": ["transformers", "Qwen2VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(model_index, f, indent=2)
        f.write("\n")


def shrink_vae_area():
    """The pipelines' 1024² area -> VAE_AREA, wherever they ask for it (a constant and a literal)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        original = module.calculate_dimensions
        module.calculate_dimensions = (lambda f: lambda area, ratio: f(VAE_AREA if area == 1024 * 1024 else area,
                                                                         ratio))(original)
    pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE = VAE_AREA


def pipeline_section():
    """case.json's `pipeline`: what every run shares; the runs are appended to `runs`."""
    return {
        "areas": {"condition": 384 * 384, "vae": VAE_AREA,
                  "note": "the pipelines' 1024*1024 (VAE images, default output size) replaced by 'vae'"},
        "prompt": PROMPT, "num_inference_steps": STEPS, "output_type": "np",
        "generator": "torch.Generator('cpu').manual_seed(seed)",
        "outputs": {
            "<run>.step<k>.latents": "the packed latents after step k (noise tokens only)",
            "<run>.transformer.hidden_states": "the first transformer call's hidden_states: noise tokens, then "
                                              "every image's packed, normalised VAE latents",
            "<run>.image": "float32 [1, H, W, 3] in [0, 1]; also <run>.image_0.png",
        },
        "runs": [],
    }


def run_pipeline(run, components, images, tensors, out_dir):
    """One PIPELINE_RUNS call with `components` (scheduler, vae, text_encoder, tokenizer, processor,
    transformer): the latents after every step, the first transformer call's hidden_states (noise
    tokens, then every image's packed reference latents), the image. Returns its case.json entry."""
    import numpy as np
    import torch
    from PIL import Image
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    tag, class_name, names, height, width, negative, true_cfg, seed = run
    classes = {"QwenImageEditPlusPipeline": QwenImageEditPlusPipeline, "QwenImageEditPipeline": QwenImageEditPipeline}
    pipe = classes[class_name](**components)
    pipe.set_progress_bar_config(disable=True)
    first_call = {}

    def hook(module, a, kwargs):
        if "hidden_states" not in first_call:
            first_call["hidden_states"] = kwargs["hidden_states"].detach().clone()
            first_call["img_shapes"] = kwargs["img_shapes"]

    handle = components["transformer"].register_forward_pre_hook(hook, with_kwargs=True)
    steps = []

    def on_step(p, i, t, kw):
        steps.append(kw["latents"].detach().clone())
        return {}

    call_images = [images[n] for n in names]
    out = pipe(image=call_images if class_name == "QwenImageEditPlusPipeline" else call_images[0], prompt=PROMPT,
               negative_prompt=negative, true_cfg_scale=true_cfg, height=height, width=width,
               num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
               callback_on_step_end=on_step)
    handle.remove()
    image = torch.from_numpy(np.ascontiguousarray(out.images))  # [1, H, W, 3]
    for k, latents in enumerate(steps):
        tensors[f"{tag}.step{k}.latents"] = latents.contiguous()
    tensors[f"{tag}.transformer.hidden_states"] = first_call["hidden_states"].contiguous()
    tensors[f"{tag}.image"] = image.float().contiguous()
    Image.fromarray((out.images[0] * 255).round().astype("uint8")).save(
        os.path.join(out_dir, f"{tag}.image_0.png"), optimize=True)
    entry = {"tag": tag, "pipeline": class_name, "images": [f"source_{n}.png" for n in names], "seed": seed,
             "true_cfg_scale": true_cfg, "output_height": int(image.shape[1]), "output_width": int(image.shape[2]),
             "img_shapes": [list(s) for s in first_call["img_shapes"][0]],
             "hidden_states_shape": list(first_call["hidden_states"].shape)}
    if height is not None:
        entry["height"], entry["width"] = height, width
    if negative is not None:
        entry["negative_prompt"] = negative
    return entry


def run_pipelines(args, images, tensors, case, text_encoder, vae, tokenizer, processor):
    """Every PIPELINE_RUNS call with the pipeline_qwenimage transformer."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    shrink_vae_area()
    comp = os.path.join(args.components, "pipeline_qwenimage")
    transformer = QwenImageTransformer2DModel.from_pretrained(os.path.join(comp, "transformer"),
                                                              torch_dtype=torch.float32).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(comp, "scheduler"))
    components = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      processor=processor, transformer=transformer)
    case["pipeline"] = pipeline_section()
    for run in PIPELINE_RUNS:
        case["pipeline"]["runs"].append(run_pipeline(run, components, images, tensors, args.out))


def load_conditioning(components, processor_config):
    """The text encoder (eager attention), the VAE, the reduced tokenizer and the Qwen2VLProcessor
    made from `processor_config` (a preprocessor_config.json), all float32 from the unpacked view."""
    import torch
    from diffusers import AutoencoderKLQwenImage
    from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2TokenizerFast, Qwen2VLImageProcessor,
                              Qwen2VLProcessor)
    from transformers.processing_utils import ProcessorMixin

    comp = os.path.join(components, "pipeline_qwenimage")
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        os.path.join(comp, "text_encoder"), torch_dtype=torch.float32, attn_implementation="eager").eval()
    vae = AutoencoderKLQwenImage.from_pretrained(os.path.join(comp, "vae"), torch_dtype=torch.float32).eval()
    with open(processor_config) as f:
        image_processor = Qwen2VLImageProcessor(**json.load(f))
    tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(components, "pipeline_flux2_klein", "tokenizer"))
    # Qwen2VLProcessor wants a video processor, which needs torchvision; no video is processed
    # here, so its type check is skipped instead of installing torchvision.
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    return text_encoder, vae, tokenizer, processor


def parse_args(description, case, venv):
    """The command line of this script and of the ones that reuse it: `case` is the folder under
    tests/golden written by default, `venv` the default virtual environment."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    golden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    parser.add_argument("--components", required=True, help="an unpacked view of the golden set")
    parser.add_argument("--out", default=os.path.join(golden, case))
    parser.add_argument("--venv", default=venv)
    parser.add_argument("--wheels", default=os.path.expanduser("~/.cache/shardit/wheels"),
                        help="a folder of wheels pip may take torch from (--find-links)")
    args = parser.parse_args()
    args.repo_golden = golden
    return args


def write_case(out, tensors, case):
    """outputs.safetensors (to be packed by hand, README.md) and case.json."""
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(out, "outputs.safetensors"))
    with open(os.path.join(out, "case.json"), "w") as f:
        json.dump(case, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print("wrote", out)


def main():
    args = parse_args(__doc__, "edit_qwenimage", "/tmp/shardit-golden-qwenimage-edit")
    ensure_venv(args)

    import torch
    import diffusers
    import transformers
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE,
                                                                           calculate_dimensions)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    write_folder(args)

    # The processor of the case's folder: its preprocessor_config.json and the reduced tokenizer
    # (read from the unpacked view: the folder links the packed files).
    text_encoder, vae, tokenizer, processor = load_conditioning(
        args.components, os.path.join(args.out, "processor", "preprocessor_config.json"))
    image_processor = processor.image_processor
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=None)

    images = {}
    for seed, (name, w, h) in enumerate(SOURCES):
        images[name] = make_image(w, h, 1000 + seed)
        images[name].save(os.path.join(args.out, f"source_{name}.png"), optimize=True)

    tensors = {}
    case = {
        "producer": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__,
                     "precision": "float32 on CPU, one thread, transformers eager attention"},
        "components": "text_encoder, vae, transformer, scheduler: links to pipeline_qwenimage/; tokenizer and "
                      "processor tokenizer files: links to pipeline_flux2_klein/tokenizer/",
        "prompt_template_drop_idx": pipe.prompt_template_encode_start_idx,
        "processor": [], "encoder": [], "vae": [],
    }
    for name in PROCESSOR_CASES:
        out = image_processor(images=[images[name]], return_tensors="pt")
        pv = out["pixel_values"].numpy()
        grid = out["image_grid_thw"][0].tolist()
        case["processor"].append({"image": f"source_{name}.png", "width": images[name].size[0],
                                  "height": images[name].size[1], "image_grid_thw": grid,
                                  "pixel_values_shape": list(pv.shape), "pixel_values_sha256": sha256(pv)})
        tensors[f"processor.{name}.pixel_values_first_row"] = torch.from_numpy(pv[0].copy())
        tensors[f"processor.{name}.pixel_values_last_row"] = torch.from_numpy(pv[-1].copy())
        tensors[f"processor.{name}.resized"] = torch.from_numpy(processor_image(image_processor, images[name]))

    with torch.no_grad():
        for key, names in ENCODER_CASES.items():
            condition_images, entry = [], {"images": [f"source_{n}.png" for n in names], "prompt": PROMPT,
                                           "condition_sizes": []}
            for n in names:
                w, h = images[n].size
                cw, ch = calculate_dimensions(CONDITION_IMAGE_SIZE, w / h)
                resized = pipe.image_processor.resize(images[n], ch, cw)
                condition_images.append(resized)
                entry["condition_sizes"].append({"width": cw, "height": ch,
                                                 "pixels_sha256": hashlib.sha256(resized.tobytes()).hexdigest()})
                tensors[f"encoder.{key}.processor_image.{len(condition_images) - 1}"] = torch.from_numpy(
                    processor_image(image_processor, resized))
            # What _get_qwen_prompt_embeds gives the text encoder.
            img_prompt = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>"
                                 for i in range(len(names)))
            txt = [pipe.prompt_template_encode.format(img_prompt + PROMPT)]
            inputs = processor(text=txt, images=condition_images, padding=True, return_tensors="pt")
            entry["text"] = txt[0]
            entry["image_grid_thw"] = inputs["image_grid_thw"].tolist()
            entry["pixel_values_sha256"] = sha256(inputs["pixel_values"].numpy())
            position_ids, _ = text_encoder.model.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], None,
                                                                attention_mask=inputs["attention_mask"])
            image_embeds = text_encoder.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            prompt_embeds, mask = pipe._get_qwen_prompt_embeds([PROMPT], condition_images, torch.device("cpu"))
            tensors[f"encoder.{key}.input_ids"] = inputs["input_ids"].contiguous()
            tensors[f"encoder.{key}.attention_mask"] = inputs["attention_mask"].contiguous()
            tensors[f"encoder.{key}.image_grid_thw"] = inputs["image_grid_thw"].contiguous()
            tensors[f"encoder.{key}.position_ids"] = position_ids.contiguous()
            tensors[f"encoder.{key}.image_embeds"] = torch.cat(list(image_embeds)).contiguous()
            tensors[f"encoder.{key}.prompt_embeds"] = prompt_embeds.contiguous()
            tensors[f"encoder.{key}.prompt_embeds_mask"] = mask.contiguous()
            case["encoder"].append(dict(entry, name=key))

        for name, (h, w) in VAE_CASES.items():
            image = pipe.image_processor.preprocess(images[name], h, w).unsqueeze(2)
            latents = pipe._encode_vae_image(image=image, generator=None)
            tensors[f"vae.{name}.image"] = image.contiguous()
            tensors[f"vae.{name}.image_latents"] = latents.contiguous()
            case["vae"].append({"name": name, "image": f"source_{name}.png", "height": h, "width": w})

        run_pipelines(args, images, tensors, case, text_encoder, vae, tokenizer, processor)

    write_case(args.out, tensors, case)


if __name__ == "__main__":
    main()
