"""`treadle chat` driven through a pty: streaming, Ctrl-C stops a reply, commands, Ctrl-D quits."""

import sys

import pexpect
import pytest


@pytest.fixture(scope="module")
def chat():
    child = pexpect.spawn(
        sys.executable,
        ["-m", "treadle", "chat", "--dtype", "float32", "--max-num-seqs", "4"],
        encoding="utf-8",
        timeout=120,
    )
    child.expect("loaded in")
    child.expect(">>> ")
    yield child
    if child.isalive():
        child.terminate(force=True)


def test_reply_streams(chat):
    chat.sendline("/params temperature=0 max_tokens=12")
    chat.expect("temperature=0")
    chat.expect(">>> ")
    chat.sendline("What is the capital of France?")
    chat.expect("Paris")
    chat.expect(">>> ")


def test_ctrl_c_stops_the_reply_not_the_program(chat):
    chat.sendline("/params max_tokens=3000")
    chat.expect(">>> ")
    chat.sendline("Write a very long story about a lighthouse.")
    chat.expect("lighthouse\\.\r\n")  # the terminal's echo of our line
    chat.expect(r"\w+ \w+ \w+")  # then some words of the reply have streamed
    chat.sendintr()
    chat.expect(r"\[stopped\]")
    chat.expect(">>> ")
    assert chat.isalive()


def test_reset_system_and_multiline(chat):
    chat.sendline("/reset")
    chat.expect("conversation cleared")
    chat.expect(">>> ")
    chat.sendline("/system You answer in one word.")
    chat.expect("system prompt set")
    chat.expect(">>> ")
    chat.sendline("/params max_tokens=8")
    chat.expect(">>> ")
    chat.sendline("Name a color \\")
    chat.expect(r"\.\.\. ")
    chat.sendline("please.")
    chat.expect(">>> ")
    chat.sendline("/nonsense")
    chat.expect("unknown command")
    chat.expect(">>> ")


def test_ctrl_d_quits(chat):
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
