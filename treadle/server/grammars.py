"""The front end's check of a request's output constraint, before the response starts.

A constraint that is too large, does not compile, or takes too long to compile is a 400 naming the
parameter that carried it, streaming or not; only constraints that compiled here reach the engine
core (which compiles them again, off its loop, and caches them). Compiling runs on worker threads
(llguidance drops the GIL), bounded by llguidance's own resource limits and by
--max-grammar-compile-seconds; a constraint that ran out of time is remembered and refused at once
the next time.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ..engine.structured import GrammarCompiler, StructuredOutputsParams, lower_thread_priority
from .protocol import RequestError

MAX_REMEMBERED_SLOW = 1024


class GrammarChecker:
    def __init__(self, tokenizer, vocab_size: int, max_bytes: int, max_seconds: float):
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="treadle-grammar-check", initializer=lower_thread_priority)
        self._too_slow: set[str] = set()

    async def check(self, so: StructuredOutputsParams, param: str) -> None:
        size = so.text_size()
        if size > self.max_bytes:
            raise RequestError(f"{param} is {size} bytes; this server accepts at most {self.max_bytes} (--max-schema-bytes)", param)
        key = so.key()
        if key in self._too_slow:
            raise self._slow_error(param)
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compiler.compile, so)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_seconds)
        except asyncio.TimeoutError:
            if len(self._too_slow) < MAX_REMEMBERED_SLOW:
                self._too_slow.add(key)
            raise self._slow_error(param) from None
        except ValueError as e:
            raise RequestError(str(e), param) from None

    def _slow_error(self, param: str) -> RequestError:
        return RequestError(f"{param} took longer than {self.max_seconds:g} s to compile (--max-grammar-compile-seconds)", param)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
