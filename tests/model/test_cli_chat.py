"""`kvserve chat` as a user drives it: /exit and /quit quit (never reach the model), a reply cut
at --max-tokens says so, Ctrl-C stops a reply and returns to the prompt (no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def chat(default_gguf: str, *flags: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve",
            "chat",
            "--model",
            default_gguf,
            "--threads",
            "1",
            "--kv-cache-memory",
            "32MiB",
            "--temperature",
            "0",
            *flags,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def test_quit_commands_and_the_max_tokens_marker(default_gguf):
    proc = chat(default_gguf, "--max-tokens", "4")
    out, _ = proc.communicate("Hello there\n/exit\n", timeout=300)
    assert proc.returncode == 0, out
    assert out.count("bot> ") == 1  # /exit was not sent to the model
    assert "[cut at --max-tokens 4]" in out
    proc = chat(default_gguf, "--max-tokens", "4")
    out, _ = proc.communicate("/quit\n", timeout=300)
    assert proc.returncode == 0 and "bot> " not in out


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(default_gguf):
    """Started with SIGINT ignored, as a non-interactive shell starts background jobs (CI, a
    loaded machine's scripts): the chat still takes Ctrl-C."""
    proc = chat(default_gguf, "--max-tokens", "400", "--ignore-eos", preexec_fn=_ignore_sigint)
    seen: list[str] = []

    def read():
        while True:
            ch = proc.stdout.read(1)
            if not ch:
                return
            seen.append(ch)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.stdin.write("Tell me a very long story.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 240
    while "bot> " not in "".join(seen) or len("".join(seen).split("bot> ", 1)[1]) < 20:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    proc.stdin.write("/quit\n")
    proc.stdin.flush()
    proc.wait(120)
    reader.join(10)
    out = "".join(seen)
    assert proc.returncode == 0, out
    assert "[stopped]" in out and "Traceback" not in out and "KeyboardInterrupt" not in out
