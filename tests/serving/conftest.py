"""A live server for the tests: a tiny random Llama with a character-level tokenizer and a chat template, saved as
an ordinary HF directory plus a DSpark drafter checkpoint, served by ``python -m optimized.serve`` on a free port.

Everything a user would do, minus the model size: the server process, its start-up, the official ``openai`` client.
The server runs the engine's torch kernels (the Triton kernels are tested op by op and end to end through the
interpreter in tests/equivalence; under the interpreter every step would take seconds).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_drafter

ROOT = Path(__file__).resolve().parents[2]
# Characters of the tiny tokenizer: printable ASCII and the newline, one token each, after the special tokens.
SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB = 128  # ≥ len(SPECIALS) + len(CHARS) = 101; the rest are unused ids the random model may still emit
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
START_TIMEOUT_S = 120  # start-up on the shared 2-core CPU: imports, tiny engine, cost profile, warm-up


def char_tokenizer():
    """A character-level fast tokenizer: BPE with no merges splits text into characters; decoding fuses them."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model():
    """A random 4-layer Llama with an untied, sharpened LM head: tied embeddings would make the tiny model repeat
    its input token, and ×30 logits (p_max ≈ 0.5 instead of 0.01) keep greedy argmaxes far from float ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, drafter directory) of the tiny served model."""
    from reference.checkpoint import save_drafter
    from reference.target import Target

    root = tmp_path_factory.mktemp("tiny-served")
    model_dir, drafter_dir = root / "model", root / "drafter"
    tiny_model().save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    target = Target.load(str(model_dir))
    save_drafter(tiny_drafter(target, gamma=4, noise=0.2), drafter_dir)
    return model_dir, drafter_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(cache: Path | None) -> dict[str, str]:
    """The server's environment: one torch thread (CI has two cores, shared with the test process), the torch
    kernels, and ``DSPARK_CACHE`` (cost tables) in ``cache`` unless None (the real target's weights cache)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if cache is not None:
        env["DSPARK_CACHE"] = str(cache)
    env.pop("TRITON_INTERPRET", None)
    return env


class LiveServer:
    """``python -m optimized.serve`` in a subprocess; ``url`` is its base URL."""

    def __init__(self, args: list[str], cache: Path | None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "optimized.serve", "--port", str(self.port), "--disable-uvicorn-access-log",
               *args]
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=server_env(cache), stdout=self._log_file,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def tiny_server_args(tiny_dirs, *extra: str) -> list[str]:
    model_dir, drafter_dir = tiny_dirs
    return ["--model", str(model_dir), "--drafter", str(drafter_dir), "--served-model-name", "tiny",
            "--max-model-len", "96", "--max-num-seqs", "8", "--max-waiting", "40", *extra]


@pytest.fixture(scope="module")
def tiny_server(tiny_dirs, tmp_path_factory):
    """The tiny model, adaptive verification, 8 slots: shared by the tests of one module."""
    cache = tmp_path_factory.mktemp("cache")
    server = LiveServer(tiny_server_args(tiny_dirs), cache, cache / "server.log")
    server.wait_ready()
    yield server
    server.stop()
