#!/usr/bin/env python3
"""Trains the built-in model's VAE and transformer to draw the scenes of tools/builtin_scenes.py.

The built-in pipeline is FLUX.1's (diffusers' FluxPipeline: CLIP + T5 text encoders with their
tokenizers, FluxTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler), small. Its
text encoders and tokenizers are the ones `shardit` writes (seeded random weights; they stay
random and frozen: their embeddings still tell the captions apart), read from the built-in folder
that `shardit inspect` makes, so the transformer learns from exactly the embeddings the engine
computes. This script trains, on CPU (`--threads`, default one) with a fixed seed:

1. the VAE (AutoencoderKL, 8 pixels per latent pixel, no attention in its middle block) as an
   autoencoder on 64x64 crops of 128x128 scenes (reconstruction of the posterior mean plus a
   little noise, and a small KL term), then on whole scenes with the shapes weighted, then its
   decoder alone with the shapes' outlines weighted (the encoder, so the latent space, fixed);
2. the transformer with rectified flow as FLUX.1 was trained: x_t = (1 - t) x_0 + t noise, the
   target noise - x_0, t drawn logit-normal and shifted with the scheduler's resolution-dependent
   mu (here the 64 tokens of a 128x128 image), the guidance input drawn from [1, 5], on latents of
   128x128 scenes (an 8x8 token grid) with the T5 prompt cut to 32 tokens as the quick start does.

It writes one safetensors file (bf16 weights of `vae.*` and `transformer.*`, with the two
components' config.json texts in its metadata), packed with xz and beside the unpacked file's
SHA-256 (`<out without .xz>.sha256`), which src/shardit/models/builtin.cpp turns into the built-in
folder, and a JSON log of the losses (`--work`/training_log.json). Run from the repository root:

    nice -n 10 python3 tools/train_builtin_model.py --shardit build/apps/shardit \
        --work build/builtin-train --out src/shardit/models/builtin_weights.safetensors.xz

It makes the virtual environment `--venv` (default build/builtin-train-venv) with the pinned
packages below and runs itself there. Each stage's steps are options (defaults: the first run of
the earlier, smaller model; the shipped weights' commands are in docs/builtin_model.md). A later
run can start from an earlier one's stages (`--vae-from`, with `--vae-decoder-steps` sharpening
its decoder; `--transformer-from`), save the
transformer's averaged weights along the way (`--checkpoint-every`), weight the loss of the tokens
the shapes touch (`--shape-weight`), add a loss on the decoded pixels of the predicted clean
image (`--pixel-weight`), train another transformer size (`--transformer-config`) and train the
empty prompt's prediction for classifier-free guidance (`--caption-dropout`).
"""
import argparse
import glob
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time

PINNED = ["torch==2.15.0", "diffusers==0.42.1", "transformers==5.23.0", "tokenizers==0.23.3",
          "huggingface_hub==2.4.0", "sentencepiece==0.2.3", "protobuf==7.36.2", "safetensors==0.8.0",
          "numpy==2.4.6", "pillow==13.0.0"]
SEED = 20261206
IMAGE_SIZE = 128  # the quick start's size: an 8x8 token grid
MAX_SEQUENCE_LENGTH = 32  # scripts/quickstart.sh's --max-sequence-length (the longest caption has 19 T5 tokens)

# The components' configs (diffusers' config.json keys). 12 heads, so that TP=2, 3 and 4 divide
# them; FLUX.1's 4-level VAE (8 pixels per latent pixel, so images are multiples of 16 pixels as
# for every FLUX.1 model) gives 64 image tokens at 128x128.
TRANSFORMER_CONFIG = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 16,
    "out_channels": None,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 12,
    "joint_attention_dim": 64,
    "pooled_projection_dim": 96,
    "guidance_embeds": True,
    "axes_dims_rope": [2, 2, 4],
}
VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [16, 32, 32, 32],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "act_fn": "silu",
    "sample_size": 128,
    "mid_block_add_attention": False,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    # scaling_factor and shift_factor: measured on the trained encoder's latents.
}


def pinned_versions_present():
    try:
        from importlib.metadata import version
        return all(version(p.split("==")[0]) == p.split("==")[1] for p in PINNED)
    except Exception:
        return False


def ensure_environment(venv):
    if pinned_versions_present():
        return
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    subprocess.check_call([python, "-m", "pip", "install", "--quiet", *PINNED])
    os.execv(python, [python, *sys.argv])


def builtin_folder(shardit, work):
    """The built-in folder `shardit` writes (under TMPDIR = work/tmp)."""
    tmp = os.path.join(work, "tmp")
    os.makedirs(tmp, exist_ok=True)
    subprocess.check_call([shardit, "inspect"], env={**os.environ, "TMPDIR": tmp}, stdout=subprocess.DEVNULL)
    found = sorted(p for p in glob.glob(os.path.join(tmp, "shardit-builtin-*")) if os.path.isdir(p) and
                   os.path.exists(os.path.join(p, ".complete")))
    if not found:
        sys.exit(f"{shardit} inspect wrote no built-in folder under {tmp}")
    return found[-1]


class TextEncoders:
    """FLUX.1's two prompt encodings (diffusers' FluxPipeline.encode_prompt) with the built-in
    encoders, memoised per caption."""

    def __init__(self, folder):
        import torch
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        self.torch = torch
        self.clip_tokenizer = CLIPTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
        self.t5_tokenizer = T5TokenizerFast.from_pretrained(os.path.join(folder, "tokenizer_2"))
        self.clip = CLIPTextModel.from_pretrained(os.path.join(folder, "text_encoder")).eval()
        self.t5 = T5EncoderModel.from_pretrained(os.path.join(folder, "text_encoder_2")).eval()
        self.memo = {}

    def ids(self, caption):
        clip = self.clip_tokenizer([caption], padding="max_length", max_length=self.clip_tokenizer.model_max_length,
                                   truncation=True, return_tensors="pt").input_ids
        t5 = self.t5_tokenizer([caption], padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                               return_tensors="pt").input_ids
        return clip, t5

    def __call__(self, captions):
        torch = self.torch
        missing = [c for c in dict.fromkeys(captions) if c not in self.memo]
        if missing:
            with torch.no_grad():
                for caption in missing:
                    clip_ids, t5_ids = self.ids(caption)
                    pooled = self.clip(clip_ids).pooler_output[0]
                    embeds = self.t5(t5_ids).last_hidden_state[0]
                    self.memo[caption] = (embeds, pooled)
        return (torch.stack([self.memo[c][0] for c in captions]), torch.stack([self.memo[c][1] for c in captions]))


def scene_batch(rng, count, size, with_objects=False):
    """Scenes as images in [-1, 1] [B, 3, H, W] and their captions (and, with `with_objects`, a
    mask [B, 1, H, W] of the pixels that are not background)."""
    import numpy as np
    import torch
    import builtin_scenes

    scenes = [builtin_scenes.random_scene(rng) for _ in range(count)]
    pixels = np.stack([np.asarray(builtin_scenes.draw(s, size), dtype=np.float32) for s in scenes])
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2) / 127.5 - 1.0
    captions = [s.caption for s in scenes]
    if not with_objects:
        return images, captions
    background = torch.tensor([s.background for s in scenes], dtype=torch.float32).view(-1, 3, 1, 1) / 127.5 - 1.0
    return images, captions, ((images - background).abs().amax(1, keepdim=True) > 0.02).float()


def update(optimizer, loss, lr, clip=None):
    """One optimizer step on `loss` at learning rate `lr` (gradients clipped to norm `clip`)."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], clip)
    optimizer.step()


def report(log, entry):
    log.append(entry)
    print(json.dumps(entry), flush=True)


def train_vae(args, log):
    import torch
    import diffusers

    rng = random.Random(SEED + 1)
    vae = diffusers.AutoencoderKL(**{k: v for k, v in vae_config(args).items() if not k.startswith("_")})
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    crop = args.vae_crop
    start = time.time()
    recent = []
    if args.vae_phase1_from:
        # The first phase's result from an earlier run of the same code (its work folder's
        # vae_phase1.pt): the weights this run would reach (the second phase has its own optimizer).
        vae.load_state_dict(torch.load(args.vae_phase1_from))
    for step in range(0 if args.vae_phase1_from else args.vae_steps):
        images, _ = scene_batch(rng, args.vae_batch, IMAGE_SIZE)
        # The same crop window for the batch (a multiple of 16 pixels: whole latent pixels).
        y, x = (rng.randrange(0, (IMAGE_SIZE - crop) // 16 + 1) * 16 for _ in range(2))
        images = images[:, :, y:y + crop, x:x + crop]
        posterior = vae.encode(images).latent_dist
        # The posterior's mean with a little noise: the decoder learns from the start what the mean
        # says (a sample's unit variance would drown it for hundreds of steps) and to tolerate the
        # transformer's small errors.
        decoded = vae.decode(posterior.mean + 0.1 * torch.randn_like(posterior.mean)).sample
        reconstruction = (decoded - images).abs().mean() + (decoded - images).pow(2).mean()
        kl = posterior.kl().mean() / (images.shape[2] * images.shape[3])
        loss = reconstruction + args.vae_kl * kl
        lr = args.vae_lr * min(1.0, (step + 1) / 25) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.vae_steps)))
        update(optimizer, loss, lr)
        recent = (recent + [reconstruction.item()])[-25:]
        if step % 25 == 0 or step == args.vae_steps - 1:
            report(log, {"stage": "vae", "step": step, "reconstruction_mean25": sum(recent) / len(recent),
                         "kl": kl.item(), "seconds": round(time.time() - start, 1)})
    torch.save(vae.state_dict(), os.path.join(args.work, "vae_phase1.pt"))
    # Phase 2: whole scenes, the shapes' pixels weighted up (in crops they are rare, and a small
    # shape is a few percent of a scene: without this the decoder paints them in the wrong colour).
    torch.manual_seed(SEED + 4)
    rng = random.Random(SEED + 4)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_shape_lr, weight_decay=0.0)
    recent = []
    for step in range(args.vae_shape_steps):
        images, _, objects = scene_batch(rng, args.vae_shape_batch, IMAGE_SIZE, with_objects=True)
        posterior = vae.encode(images).latent_dist
        decoded = vae.decode(posterior.mean + 0.1 * torch.randn_like(posterior.mean)).sample
        weight = 1.0 + (args.vae_shape_weight - 1.0) * objects
        error = decoded - images
        reconstruction = (weight * (error.abs() + error.pow(2))).mean() / weight.mean()
        kl = posterior.kl().mean() / (images.shape[2] * images.shape[3])
        loss = reconstruction + args.vae_kl * kl
        lr = args.vae_shape_lr * 0.5 * (1 + math.cos(math.pi * step / args.vae_shape_steps))
        update(optimizer, loss, lr)
        recent = (recent + [reconstruction.item()])[-25:]
        if step % 25 == 0 or step == args.vae_shape_steps - 1:
            report(log, {"stage": "vae_shapes", "step": step,
                         "weighted_reconstruction_mean25": sum(recent) / len(recent), "kl": kl.item(),
                         "seconds": round(time.time() - start, 1)})
    return vae.eval()


def sharpen_vae_decoder(args, vae, log):
    """Phase 3: the decoder alone, the encoder frozen (so its latent space, and a transformer
    trained on it, stay valid). After phases 1 and 2 the decoder draws every shape soft and round (a
    square's corners, a triangle's apex) although the latents tell them apart; here it learns to
    draw their edges: the pixels along a shape's outline weighted `--vae-decoder-edge-weight`
    times the background's, the shape's inside `--vae-shape-weight` times, and latent noise of
    `--vae-decoder-noise` (the transformer's errors are of that size) so that it stays robust."""
    import torch

    torch.manual_seed(SEED + 5)
    rng = random.Random(SEED + 5)
    vae.requires_grad_(False)
    vae.decoder.requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.decoder.parameters(), lr=args.vae_decoder_lr, weight_decay=0.0)
    start = time.time()
    recent = []
    for step in range(args.vae_decoder_steps):
        images, _, objects = scene_batch(rng, args.vae_decoder_batch, IMAGE_SIZE, with_objects=True)
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.mean
        decoded = vae.decode(latents + args.vae_decoder_noise * torch.randn_like(latents)).sample
        # A shape's outline: the pixels within 2 of both a shape pixel and a background pixel.
        grown = torch.nn.functional.max_pool2d(objects, 5, stride=1, padding=2)
        shrunk = -torch.nn.functional.max_pool2d(-objects, 5, stride=1, padding=2)
        outline = grown - shrunk
        weight = 1.0 + (args.vae_shape_weight - 1.0) * objects + (args.vae_decoder_edge_weight - 1.0) * outline
        error = decoded - images
        reconstruction = (weight * (error.abs() + error.pow(2))).mean() / weight.mean()
        lr = args.vae_decoder_lr * min(1.0, (step + 1) / 25) * 0.5 * (1 + math.cos(math.pi * step / args.vae_decoder_steps))
        update(optimizer, reconstruction, lr)
        recent = (recent + [reconstruction.item()])[-25:]
        if step % 25 == 0 or step == args.vae_decoder_steps - 1:
            report(log, {"stage": "vae_decoder", "step": step, "weighted_reconstruction_mean25": sum(recent) / len(recent),
                         "seconds": round(time.time() - start, 1)})
    vae.requires_grad_(True)
    return vae.eval()


def pack(latents):
    """diffusers' FluxPipeline._pack_latents: [B, C, H, W] -> [B, H/2 * W/2, C * 4]."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens, h, w):
    """pack's inverse: [B, H/2 * W/2, C * 4] -> [B, C, H, W]."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def encode_dataset(args, vae, log):
    """Scenes, their captions, the VAE's latent means (the transformer's data set), which latent
    pixels the shapes touch ([N, 1, H/8, W/8], 1 where any of the 8x8 pixels is not background),
    and with `--pixel-weight` the scenes themselves (fp16 [N, 3, H, W]) and their shapes' pixels
    ([N, 1, H, W])."""
    import torch

    rng = random.Random(SEED + 2)
    latents, captions, shapes, scenes, scene_shapes = [], [], [], [], []
    start = time.time()
    with torch.no_grad():
        for first in range(0, args.scenes, 32):
            images, batch_captions, objects = scene_batch(rng, min(32, args.scenes - first), IMAGE_SIZE,
                                                          with_objects=True)
            latents.append(vae.encode(images).latent_dist.mean)
            captions.extend(batch_captions)
            shapes.append(torch.nn.functional.max_pool2d(objects, 8))
            if args.pixel_weight:
                scenes.append(images.half())
                scene_shapes.append(objects.bool())
    latents = torch.cat(latents)
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    report(log, {"stage": "encode", "scenes": args.scenes, "shift_factor": shift, "scaling_factor": scale,
                 "seconds": round(time.time() - start, 1)})
    pixels = (torch.cat(scenes), torch.cat(scene_shapes)) if args.pixel_weight else None
    return latents, captions, torch.cat(shapes), pixels, shift, scale


def load_transformer(model, path):
    """`model`'s weights from an earlier run: a state dict saved with torch.save (a work folder's
    transformer_step*.pt) or the `transformer.*` tensors of a built-in weights file (.safetensors,
    or .safetensors.xz as shipped)."""
    import lzma
    import torch
    from safetensors.torch import load as load_safetensors

    if path.endswith(".pt"):
        state = torch.load(path)
    else:
        with (lzma.open(path) if path.endswith(".xz") else open(path, "rb")) as f:
            tensors = load_safetensors(f.read())
        state = {k[len("transformer."):]: v.float() for k, v in tensors.items() if k.startswith("transformer.")}
    model.load_state_dict(state)


def transformer_config(args):
    """TRANSFORMER_CONFIG with `--transformer-config`'s keys (a JSON object) in place of its own."""
    return {**TRANSFORMER_CONFIG, **json.loads(args.transformer_config or "{}")}


def vae_config(args):
    """VAE_CONFIG with `--vae-config`'s keys (a JSON object) in place of its own."""
    return {**VAE_CONFIG, **json.loads(args.vae_config or "{}")}


def train_transformer(args, latents, captions, shapes, text, log, pixels=None, vae=None, shift=0.0, scale=1.0):
    import torch
    import diffusers

    torch.manual_seed(SEED + 3)
    rng = random.Random(SEED + 3)
    model = diffusers.FluxTransformer2DModel(**{k: v for k, v in transformer_config(args).items() if not k.startswith("_")})
    if args.transformer_from:
        load_transformer(model, args.transformer_from)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    b, c, h, w = latents.shape
    img_ids = torch.zeros(h // 2 * (w // 2), 3)
    img_ids[:, 1] = torch.arange(h // 2).repeat_interleave(w // 2).float()
    img_ids[:, 2] = torch.arange(w // 2).repeat(h // 2).float()
    txt_ids = torch.zeros(MAX_SEQUENCE_LENGTH, 3)
    # diffusers' calculate_shift with the scheduler's values, for this image's token count.
    m = (1.15 - 0.5) / (4096 - 256)
    mu = (h // 2) * (w // 2) * m + (0.5 - m * 256)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start = time.time()
    recent, recent_plain, recent_pixel = [], [], []
    last = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    for step in range(last):
        index = torch.tensor([rng.randrange(b) for _ in range(args.batch)])
        x0 = latents[index]
        batch_captions = [captions[i] for i in index.tolist()]
        if args.caption_dropout > 0:
            # That share of the samples learn the empty prompt's prediction (the unconditional one
            # that classifier-free guidance needs).
            batch_captions = ["" if rng.random() < args.caption_dropout else c for c in batch_captions]
        embeds, pooled = text(batch_captions)
        noise = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(args.batch))
        t = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        guidance = torch.rand(args.batch) * 4 + 1
        prediction = model(hidden_states=pack(xt), encoder_hidden_states=embeds, pooled_projections=pooled, timestep=t,
                           img_ids=img_ids, txt_ids=txt_ids, guidance=guidance).sample
        error = (prediction - pack(noise - x0)).pow(2)
        # The tokens the shapes touch weighted `--shape-weight` times the background's (a shape is a
        # few tokens of 64: unweighted, most of the loss is flat background).
        weight = 1.0 + (args.shape_weight - 1.0) * pack(shapes[index].expand(-1, c, -1, -1))
        loss = (weight * error).mean() / weight.mean()
        if args.pixel_weight:
            # The predicted clean latents (x_t - t v) of the first --pixel-batch samples, decoded by
            # the frozen VAE and compared with their scenes: the corners that tell a circle from a
            # square are a few pixels, and a small change of the latents.
            n = min(args.pixel_batch, args.batch)
            x0_predicted = unpack(pack(xt[:n]) - t[:n].view(-1, 1, 1) * prediction[:n], h, w)
            drawn = vae.decode(x0_predicted / scale + shift).sample
            scene, inside = pixels[0][index[:n]].float(), pixels[1][index[:n]].float()
            pixel_weight = 1.0 + (args.shape_weight - 1.0) * inside
            pixel_loss = (pixel_weight * (drawn - scene).pow(2)).mean() / pixel_weight.mean()
            loss = loss + args.pixel_weight * pixel_loss
            recent_pixel = (recent_pixel + [pixel_loss.item()])[-50:]
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        update(optimizer, loss, lr, clip=1.0)
        with torch.no_grad():
            decay = min(0.999, (1 + step) / (10 + step))
            for k, v in model.state_dict().items():
                ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        recent = (recent + [loss.item()])[-50:]
        recent_plain = (recent_plain + [error.mean().item()])[-50:]
        if step % 50 == 0 or step == last - 1:
            report(log, {"stage": "transformer", "step": step, "loss_mean50": sum(recent) / len(recent),
                         "unweighted_loss_mean50": sum(recent_plain) / len(recent_plain),
                         **({"pixel_loss_mean50": sum(recent_pixel) / len(recent_pixel)} if recent_pixel else {}), "lr": lr,
                         "seconds": round(time.time() - start, 1)})
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            torch.save(ema, os.path.join(args.work, f"transformer_step{step + 1}.pt"))
    model.load_state_dict(ema)
    return model.eval()


def save(args, vae, model, shift, scale, log):
    import torch
    from safetensors.torch import save_file

    config = {**vae_config(args), "scaling_factor": scale, "shift_factor": shift}
    tensors = {}
    for prefix, module in (("vae.", vae), ("transformer.", model)):
        for name, value in module.state_dict().items():
            tensors[prefix + name] = value.to(torch.bfloat16).contiguous()
    plain = os.path.join(args.work, "builtin_weights.safetensors")
    save_file(tensors, plain, metadata={"transformer_config": json.dumps(transformer_config(args)),
                                        "vae_config": json.dumps(config), "seed": str(SEED)})
    with open(args.out, "wb") as out:
        subprocess.check_call(["xz", "-9e", "--stdout", plain], stdout=out)
    # The unpacked file's SHA-256 beside it, as configure checks it (the golden files' format).
    with open(plain, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    checksum = args.out[:-len(".xz")] + ".sha256" if args.out.endswith(".xz") else args.out + ".sha256"
    with open(checksum, "w") as out:
        out.write(f"{digest}  {os.path.basename(plain)}\n")
    with open(os.path.join(args.work, "training_log.json"), "w") as out:
        json.dump(log, out, indent=1)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) from {plain} ({os.path.getsize(plain)} bytes)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shardit", help="the shardit binary (writes the built-in folder)")
    source.add_argument("--builtin", help="a built-in folder shardit wrote (its text encoders and tokenizers are read)")
    parser.add_argument("--work", required=True, help="a folder for the run's files")
    parser.add_argument("--out", required=True, help="the packed weights to write (.safetensors.xz)")
    parser.add_argument("--venv", default="build/builtin-train-venv")
    parser.add_argument("--vae-steps", type=int, default=1000)
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--vae-crop", type=int, default=64)
    parser.add_argument("--vae-lr", type=float, default=4e-4)
    parser.add_argument("--vae-kl", type=float, default=1e-4)
    parser.add_argument("--vae-shape-steps", type=int, default=400)
    parser.add_argument("--vae-shape-batch", type=int, default=4)
    parser.add_argument("--vae-shape-lr", type=float, default=2e-4)
    parser.add_argument("--vae-shape-weight", type=float, default=8.0)
    parser.add_argument("--vae-phase1-from", help="the VAE's first phase from an earlier run (vae_phase1.pt)")
    parser.add_argument("--vae-decoder-steps", type=int, default=0,
                        help="phase 3: steps of the decoder alone (encoder frozen) drawing the shapes' outlines")
    parser.add_argument("--vae-decoder-batch", type=int, default=8)
    parser.add_argument("--vae-decoder-lr", type=float, default=3e-4)
    parser.add_argument("--vae-decoder-noise", type=float, default=0.05)
    parser.add_argument("--vae-decoder-edge-weight", type=float, default=16.0)
    parser.add_argument("--vae-from", help="the VAE of an earlier run (its work folder's vae.pt) instead of training one")
    parser.add_argument("--scenes", type=int, default=1280)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--shape-weight", type=float, default=1.0,
                        help="the loss weight of the tokens the shapes touch, relative to the background's")
    parser.add_argument("--pixel-weight", type=float, default=0.0,
                        help="add the squared error of the decoded predicted clean image, this many times")
    parser.add_argument("--pixel-batch", type=int, default=8, help="the samples of each batch that --pixel-weight decodes")
    parser.add_argument("--transformer-from",
                        help="start the transformer from an earlier run's (a transformer_step*.pt of its work folder, "
                             "or a built-in weights file: .safetensors or .safetensors.xz)")
    parser.add_argument("--stop-at", type=int, help="end the transformer's training after this many steps "
                        "(the learning-rate schedule stays that of --steps)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save the transformer's averaged weights every this many steps (work/transformer_step*.pt)")
    parser.add_argument("--transformer-config", help="a JSON object of config.json keys that replace the "
                        "transformer's defaults (TRANSFORMER_CONFIG), e.g. '{\"num_layers\": 2}'")
    parser.add_argument("--vae-config", help="a JSON object of config.json keys that replace the VAE's "
                        "defaults (VAE_CONFIG), e.g. '{\"latent_channels\": 16}' (then the transformer's "
                        "in_channels is 4 times that)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (the first runs used one, the shipped weights' runs two)")
    parser.add_argument("--caption-dropout", type=float, default=0.0,
                        help="the share of samples trained with the empty prompt (for classifier-free guidance)")
    args = parser.parse_args()
    ensure_environment(os.path.abspath(args.venv))

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    os.makedirs(args.work, exist_ok=True)
    folder = args.builtin or builtin_folder(os.path.abspath(args.shardit), os.path.abspath(args.work))
    text = TextEncoders(folder)
    log = []
    if args.vae_from:
        import diffusers
        vae = diffusers.AutoencoderKL(**{k: v for k, v in vae_config(args).items() if not k.startswith("_")})
        vae.load_state_dict(torch.load(args.vae_from))
        vae.eval()
    else:
        vae = train_vae(args, log)
    if args.vae_decoder_steps:
        vae = sharpen_vae_decoder(args, vae, log)
    if args.vae_decoder_steps or not args.vae_from:
        torch.save(vae.state_dict(), os.path.join(args.work, "vae.pt"))
    latents, captions, shapes, pixels, shift, scale = encode_dataset(args, vae, log)
    latents = (latents - shift) * scale
    for parameter in vae.parameters():
        parameter.requires_grad_(False)
    model = train_transformer(args, latents, captions, shapes, text, log, pixels, vae, shift, scale)
    save(args, vae, model, shift, scale, log)


if __name__ == "__main__":
    main()
