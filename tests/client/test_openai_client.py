#!/usr/bin/env python3
"""`shardit serve` driven by OpenAI's official Python client, as a user meets it.

Installs the pinned `openai` release from PyPI into a virtual environment in the build folder
(once; later runs reuse it), then serves the golden FLUX.2 [klein] pipeline and the golden FLUX.1
pipeline as FluxKontextPipeline, at TP=1 and TP=2, and drives them with the client:
models.list, images.generate (b64_json and url), images.edit with one and with two image files
(multipart/form-data, as the client sends edits), which must give the PNG `shardit generate
--image` gives for the same seed, size and steps; with a mask (the named 400), with
output_format "jpeg", with every standard OpenAI field (200, with warnings), and errors checked
through the client's exception types and messages. It also runs the `curl -F` example of
docs/serving.md.

Exit codes: 0 passed, 1 failed, 77 skipped (only when PyPI cannot be reached, with the reason:
CTest's SKIP_RETURN_CODE reports it as skipped, never as passed).
Waits are on events (the server's "listening on" line, /health answering 200, a process's exit),
never on a clock; a hung server is ended by CTest's timeout.
"""
import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from pinned_venv import pinned_python  # noqa: E402

# The newest release of the official client when this test was written; its images.edit takes a
# list of image files (sent as `image[]` parts).
OPENAI_RELEASE = "3.63.0"

PROMPT = "A cat holding a sign that says hello world"
SIZE = "64x48"
STEPS = 2
SEED = 7


# ---------------------------------------------------------------------------------------------
# The client's virtual environment


def client_python(venv):
    """The venv's python with openai==OPENAI_RELEASE installed; exits 77 when PyPI is out of reach."""
    return pinned_python(venv, f"import openai, sys; sys.exit(openai.__version__ != '{OPENAI_RELEASE}')",
                         [f"openai=={OPENAI_RELEASE}"], "the official openai client", "openai")


# ---------------------------------------------------------------------------------------------
# Servers and reference images


class Server:
    """`shardit [--nproc-per-node N] serve --port 0 ...`, ready once /health answers 200."""

    def __init__(self, cli, ranks, args, log_path):
        launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
        command = [cli, *launch, "--timeout", "60", "serve", "--port", "0", *args]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port = 0
        for line in self.process.stdout:  # each line as the server prints it
            self.log.write(line)
            self.log.flush()
            match = re.search(r"listening on http://[^:]+:([0-9]+)", line)
            if match:
                self.port = int(match.group(1))
                break
        if not self.port:
            self.process.wait()
            raise AssertionError(f"serve exited ({self.process.returncode}) before listening:\n{self.output()}")
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        asked = threading.Event()
        while True:  # answers 503 until loaded; the listening line comes after the load
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=60) as health:
                    if health.status == 200:
                        break
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    raise
            asked.wait(0.02)  # between two questions, not a guess at how long the load takes

    def _drain(self):
        for line in self.process.stdout:
            self.log.write(line)
            self.log.flush()

    def output(self):
        with open(self.log_path) as log:
            return log.read()

    def stop(self):
        """SIGTERM, then the exit code must be 0."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait()
        assert code == 0, f"serve exited {code} after SIGTERM:\n{self.output()}"


def png_pixels(data, what):
    """A PNG's header and its inflated image data: equal for equal pixels from the same encoder,
    whatever text chunks the file carries."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{what}: not a PNG (starts {data[:8]!r})"
    pos, header, idat = 8, b"", []
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    return header, zlib.decompress(b"".join(idat))


def png_size(data):
    header, _ = png_pixels(data, "image")
    return int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")


def generate_png(cli, ranks, model_args, images, out):
    """`shardit generate --image ...`'s PNG for the test's prompt, seed, size and steps."""
    launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    width, height = SIZE.split("x")
    command = [cli, *launch, "generate", *model_args, "--prompt", PROMPT, "--seed", str(SEED), "--width", width,
               "--height", height, "--steps", str(STEPS), "--out", out]
    for image in images:
        command += ["--image", image]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode == 0, f"{' '.join(command)} failed:\n{run.stdout}{run.stderr}"
    with open(out, "rb") as png:
        return png.read()


# ---------------------------------------------------------------------------------------------
# The cases


def expect_same_image(served, expected, what):
    assert png_pixels(served, what) == png_pixels(expected, what), \
        f"{what}: the served image differs from shardit generate --image's"
    print(f"ok: {what} equals shardit generate --image's PNG", flush=True)


def expect_refusal(call, error_type, status, message_start, param, what):
    import openai
    try:
        call()
    except error_type as error:
        assert error.status_code == status, f"{what}: status {error.status_code}, expected {status}"
        message = error.body.get("message", "") if isinstance(error.body, dict) else ""
        assert message.startswith(message_start), f"{what}: message {message!r}, expected {message_start!r}..."
        assert error.param == param, f"{what}: param {error.param!r}, expected {param!r}"
        print(f"ok: {what}: {type(error).__name__} {status} {message[:80]!r}...", flush=True)
        return
    except openai.APIError as error:
        raise AssertionError(f"{what}: {type(error).__name__} ({error}), expected {error_type.__name__}")
    raise AssertionError(f"{what}: accepted, expected {error_type.__name__}")


def klein_cases(client, model, server, cli, ranks, references, work):
    import openai
    tp = f"TP={ranks}"
    diffusion = {"seed": SEED, "num_inference_steps": STEPS}
    listed = [entry.id for entry in client.models.list().data]
    assert listed[:1] == [model], f"models.list: {listed}, expected {model} first"
    print(f"ok: models.list {listed}", flush=True)

    generated = client.images.generate(model=model, prompt=PROMPT, size=SIZE, n=1, response_format="b64_json",
                                       extra_body=diffusion)
    b64_png = base64.b64decode(generated.data[0].b64_json)
    assert png_size(b64_png) == (64, 48), png_size(b64_png)
    by_url = client.images.generate(model=model, prompt=PROMPT, size=SIZE, response_format="url", extra_body=diffusion)
    with urllib.request.urlopen(by_url.data[0].url, timeout=60) as answer:
        url_png = answer.read()
    assert png_pixels(url_png, "url") == png_pixels(b64_png, "b64_json"), "the url answer's image differs"
    print(f"ok: images.generate b64_json and url ({by_url.data[0].url}) {tp}", flush=True)

    with open(references[0], "rb") as a:
        one = client.images.edit(model=model, image=a, prompt=PROMPT, size=SIZE, response_format="b64_json",
                                 extra_body=diffusion)
    expected_one = generate_png(cli, ranks, ["--model", server["model_dir"]], references[:1], f"{work}/klein_a.png")
    expect_same_image(base64.b64decode(one.data[0].b64_json), expected_one, f"klein images.edit one file {tp}")

    with open(references[0], "rb") as a, open(references[1], "rb") as b:
        two = client.images.edit(model=model, image=[a, b], prompt=PROMPT, size=SIZE, extra_body=diffusion)
    expected_two = generate_png(cli, ranks, ["--model", server["model_dir"]], references, f"{work}/klein_ab.png")
    two_png = base64.b64decode(two.data[0].b64_json)
    expect_same_image(two_png, expected_two, f"klein images.edit two files {tp}")
    assert png_pixels(two_png, "two") != png_pixels(expected_one, "one"), "the second image changed nothing"

    with open(references[0], "rb") as a:
        jpeg = client.images.edit(model=model, image=a, prompt=PROMPT, size=SIZE, output_format="jpeg",
                                  output_compression=90, extra_body=diffusion)
    jpeg_bytes = base64.b64decode(jpeg.data[0].b64_json)
    assert jpeg_bytes[:3] == b"\xff\xd8\xff", f"output_format jpeg: the answer starts {jpeg_bytes[:8]!r}"
    print(f"ok: images.edit output_format jpeg ({len(jpeg_bytes)} bytes) {tp}", flush=True)

    # Every standard field of OpenAI's request: 200, with a warning for each that changes nothing.
    with open(references[0], "rb") as a:
        full = client.images.edit(model=model, image=a, prompt=PROMPT, size=SIZE, n=1, response_format="b64_json",
                                  background="opaque", input_fidelity="high", output_format="png",
                                  output_compression=100, partial_images=0, quality="high", stream=False, user="u1",
                                  safety_identifier="s1", complexity="low", frame_count=1, frame_duration_ms=100,
                                  extra_body={**diffusion, "style": "vivid", "moderation": "low"})
    warnings = (full.model_extra or {}).get("warnings", [])
    for field in ("quality", "style", "moderation", "input_fidelity", "partial_images", "user", "output_compression",
                  "safety_identifier", "complexity", "frame_count", "frame_duration_ms"):
        assert any(w.startswith(f"'{field}' was ignored") for w in warnings), f"no warning for {field}: {warnings}"
    print(f"ok: images.edit with every standard field: 200, warnings {len(warnings)}", flush=True)

    with open(references[0], "rb") as a, open(references[1], "rb") as mask:
        expect_refusal(lambda: client.images.edit(model=model, image=a, mask=mask, prompt=PROMPT),
                       openai.BadRequestError, 400, "'mask' is not supported: no pipeline this server can serve "
                       "inpaints", "mask", "images.edit with a mask")
    expect_refusal(lambda: client.images.generate(model=model, prompt=PROMPT, size="100x64"),
                   openai.BadRequestError, 400, "'size' 100x64 is not supported by this model: width and height "
                   "must be multiples of 16 (e.g. 96x64)", "size", "images.generate size 100x64")
    with open(references[0], "rb") as a:
        expect_refusal(lambda: client.images.edit(model="dall-e-2", image=a, prompt=PROMPT),
                       openai.NotFoundError, 404, "the model \"dall-e-2\" does not exist", "model",
                       "images.edit model dall-e-2")
    with open(references[0], "rb") as a:
        expect_refusal(lambda: client.images.edit(model=model, image=a, prompt=PROMPT, stream=True),
                       openai.BadRequestError, 400, "'stream' true is not supported", "stream",
                       "images.edit stream=True")


def docs_curl_example(docs, server, references, work):
    """Runs the `curl -F` example of docs/serving.md against `server` (its port, the test's size
    and steps, the golden reference images as its files)."""
    with open(docs) as text:
        blocks = re.findall(r"```sh\n(.*?)```", text.read(), re.S)
    examples = [block for block in blocks if "/v1/images/edits" in block and " -F " in block]
    assert len(examples) == 1, f"docs/serving.md: {len(examples)} sh blocks with a curl -F edit, expected 1"
    script = examples[0].replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    script = re.sub(r"size=[0-9]+x[0-9]+", f"size={SIZE}", script)
    script = re.sub(r"num_inference_steps=[0-9]+", f"num_inference_steps={STEPS}", script)
    folder = os.path.join(work, "curl_example")
    os.makedirs(folder)
    files = re.findall(r"@([A-Za-z0-9_.-]+)", script)
    assert files, "the curl example sends no file"
    for name, reference in zip(files, references * len(files)):
        shutil.copy(reference, os.path.join(folder, name))
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, capture_output=True, text=True)
    assert run.returncode == 0, f"the docs' curl example failed:\n{script}\n{run.stdout}{run.stderr}"
    written = re.findall(r'open\("([A-Za-z0-9_.-]+)", "wb"\)', script)
    assert written, "the curl example writes no image"
    with open(os.path.join(folder, written[-1]), "rb") as png:
        assert png_size(png.read()) == (64, 48)
    print(f"ok: the curl -F example of docs/serving.md ({len(files)} files) -> {written[-1]}", flush=True)


def kontext_cases(client, model, server, cli, ranks, references, work):
    with open(references[0], "rb") as a:
        edited = client.images.edit(model=model, image=a, prompt=PROMPT, size=SIZE,
                                    extra_body={"seed": SEED, "num_inference_steps": STEPS})
    width, height = (int(side) for side in SIZE.split("x"))
    expected = generate_png(cli, ranks, ["--model", server["model_dir"], "--pipeline", "FluxKontextPipeline",
                                         "--max-area", str(width * height)], references[:1], f"{work}/kontext_a.png")
    expect_same_image(base64.b64decode(edited.data[0].b64_json), expected, f"kontext images.edit one file TP={ranks}")


def run_cases(args):
    import openai
    print(f"openai {openai.__version__}", flush=True)
    golden = os.environ.get("SHARDIT_GOLDEN_DIR", args.golden)
    references = [os.path.join(golden, "edit_flux1_kontext", name) for name in ("reference_a.png", "reference_b.png")]
    servers = [
        ("klein", {"model_dir": os.path.join(golden, "pipeline_flux2_klein"), "args": []}, klein_cases),
        ("kontext", {"model_dir": os.path.join(golden, "pipeline_flux1"), "args": ["--pipeline", "FluxKontextPipeline"]},
         kontext_cases),
    ]
    work = tempfile.mkdtemp(prefix="shardit-openai-client-")
    for ranks in (1, 2):
        for name, spec, cases in servers:
            folder = os.path.join(work, f"{name}_tp{ranks}")
            os.makedirs(os.path.join(folder, "images"))
            server = Server(args.cli, ranks, ["--model", spec["model_dir"], *spec["args"], "--output-dir",
                                              os.path.join(folder, "images")], os.path.join(folder, "serve.log"))
            try:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
                model = os.path.basename(spec["model_dir"])
                cases(client, model, spec, args.cli, ranks, references, folder)
                if name == "klein" and ranks == 1:
                    docs_curl_example(args.docs, server, references, folder)
            except BaseException:
                print(f"--- {name} TP={ranks} server output:\n{server.output()}", flush=True)
                server.process.kill()
                raise
            server.stop()
    shutil.rmtree(work, ignore_errors=True)
    print("PASSED", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cli", help="the shardit executable (required unless --only-venv)")
    parser.add_argument("--golden", help="the golden data's folder (tests/golden in the build)")
    parser.add_argument("--docs", help="docs/serving.md")
    parser.add_argument("--venv", required=True, help="where the client's virtual environment is kept")
    parser.add_argument("--only-venv", action="store_true",
                        help="make (or check) the virtual environment, then stop (scripts/test.sh, during the build)")
    parser.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.only_venv:
        missing = [f"--{name}" for name in ("cli", "golden", "docs") if getattr(args, name) is None]
        if missing:
            parser.error(f"{', '.join(missing)} required")
    if not args.in_venv:
        python = client_python(args.venv)
        if args.only_venv:
            sys.exit(0)
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:], "--in-venv"])
    run_cases(args)


if __name__ == "__main__":
    main()
