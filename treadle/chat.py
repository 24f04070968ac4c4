"""`treadle chat`: talk to a model in the terminal, on the engine directly (no server).

Enter sends; a line ending in a backslash continues the message, and text between two lines of
three double quotes is sent as one message. Ctrl-C stops the current reply (the request is aborted
between engine steps) without quitting; Ctrl-D quits.
"""

import itertools
import shlex
import signal
import sys
import threading
import time

from treadle.sampling_params import SamplingParams

HELP = """commands:
  /reset            forget the conversation
  /system TEXT      set the system prompt (/system alone clears it)
  /params           show sampling settings; /params temperature=0.2 max_tokens=200 top_p=0.9 ... sets them
  /image PATH       attach an image (a file, or an http(s) or data: URL) to your next message (a model that sees)
  /help             this text
Ctrl-C stops a reply, Ctrl-D quits. End a line with \\ to continue it, or wrap a message in \"\"\"."""

PARAM_TYPES = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int, "seed": int,
               "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}  # fmt: skip


def load_with_progress(config):
    """Build the engine while a spinner with the elapsed time runs on stderr."""
    from treadle.engine.llm_engine import LLMEngine

    done = threading.Event()
    start = time.monotonic()

    def spin():
        for ch in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                break
            sys.stderr.write(f"\rloading model {ch} {time.monotonic() - start:4.1f}s")
            sys.stderr.flush()
        sys.stderr.write(f"\rloaded in {time.monotonic() - start:.1f}s      \n")
        sys.stderr.flush()

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        return LLMEngine(config)
    finally:
        done.set()
        spinner.join()


def read_message() -> str | None:
    """One message from the user; None on Ctrl-D."""
    try:
        line = input(">>> ")
    except EOFError:
        return None
    if line.strip() == '"""':
        lines = []
        while True:
            more = input("... ")
            if more.strip() == '"""':
                return "\n".join(lines)
            lines.append(more)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input("... "))
    return "\n".join(lines)


class ChatSession:
    def __init__(self, engine, out=sys.stdout):
        self.engine = engine
        self.out = out
        self.history: list[dict] = []
        self.system: str | None = None
        self.params = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 1024}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.images: list = []  # attached with /image, sent with the next message

    def command(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        if name == "/reset":
            self.history.clear()
            self.say("conversation cleared")
        elif name == "/system":
            self.system = rest.strip() or None
            self.say("system prompt set" if self.system else "system prompt cleared")
        elif name == "/params":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                if key not in PARAM_TYPES or not value:
                    self.say(f"unknown setting {item!r}; settable: {', '.join(PARAM_TYPES)}")
                    return
                try:
                    self.params[key] = PARAM_TYPES[key](value)
                    SamplingParams(**self.params)
                except ValueError as e:
                    self.params.pop(key, None)
                    self.say(f"invalid {key}: {e}")
                    return
            self.say(" ".join(f"{k}={v}" for k, v in self.params.items()))
        elif name == "/image":
            self.attach(rest.strip())
        elif name in ("/help", "/?"):
            self.say(HELP)
        else:
            self.say(f"unknown command {name}; /help lists them")

    def attach(self, where: str) -> None:
        if not where:
            self.say("usage: /image PATH (or an http(s) or data: URL)")
            return
        try:
            self.engine.vision_prompts  # noqa: B018 - a model that takes no images says so now
            from treadle.media.vision_prompt import load_image

            image = load_image(where)
        except ValueError as e:
            self.say(f"error: {e}")
            return
        self.images.append(image)
        self.say(f"image attached ({image.width}x{image.height}); it goes with your next message")

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def reply(self, text: str) -> None:
        content = text
        if self.images:  # the attached images before the text, as a chat client sends them
            content = [{"type": "image_pil", "image_pil": img} for img in self.images] + [
                {"type": "text", "text": text}
            ]
        self.history.append({"role": "user", "content": content})
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.history
        tok = self.engine.tokenizer
        try:
            images, inputs = [], None
            if any(isinstance(m["content"], list) for m in messages):
                from treadle.media.vision_prompt import split_images

                messages, images = split_images(messages)
            prompt = tok.apply_chat_template(messages)
            if images:
                prompt, inputs = self.engine.vision_prompts.build(prompt, images, add_special_tokens=False)
            request_id = f"chat-{next(self._ids)}"
            params = SamplingParams(**self.params)
            self.engine.add_request(request_id, prompt, params, add_special_tokens=False, images=inputs)
        except ValueError as e:
            self.history.pop()
            self.say(f"error: {e}")
            return
        self.images = []
        self._stop.clear()
        previous = signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        answer, finish = "", None
        try:
            while finish is None:
                if self._stop.is_set():
                    self.engine.abort_request(request_id)
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    for c in out.outputs:
                        answer += c.text
                        self.out.write(c.text)
                        self.out.flush()
                        finish = c.finish_reason or finish
        finally:
            signal.signal(signal.SIGINT, previous)
        self.out.write("\n[stopped]\n" if finish == "abort" else "\n")
        self.out.flush()
        self.history.append({"role": "assistant", "content": answer})


def cmd_chat(args) -> int:
    from treadle.engine_config import engine_config_from_args

    if args.model_pos:
        args.model = args.model_pos
    engine = load_with_progress(engine_config_from_args(args))
    if not engine.tokenizer.chat_template:
        print(f"treadle: error: {engine.model_name} has no chat template", file=sys.stderr)
        return 2
    session = ChatSession(engine)
    session.say(f"treadle chat with {engine.model_name}. /help for commands, Ctrl-C stops a reply, Ctrl-D quits.")
    while True:
        try:
            text = read_message()
        except KeyboardInterrupt:
            session.say("")
            continue
        if text is None:
            session.say("")
            return 0
        if not text.strip():
            continue
        if text.startswith("/"):
            session.command(text.strip())
        else:
            session.reply(text)
