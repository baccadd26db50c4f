"""A request as its caller sees it: its n completions, and the output each step makes of them.

Each completion is one engine `Request` (a request of n is n of them, which the scheduler runs
independently), with its text made incrementally and how many of its tokens went out before. An
output carries what is new since the last one (`delta_text`, `delta_token_ids`); the request's
final output also carries each completion whole (`text`, `token_ids`), for the offline API. No
step copies what earlier steps already sent: a long output costs each step its new tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer


@dataclass(slots=True)
class Completion:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: token ids only (a worker's; its router makes the text)
    index: int  # which of the request's n completions
    num_tokens_sent: int = 0
    num_logprobs_sent: int = 0
    num_tokens_detokenized: int = 0  # of the request's output tokens, those its detokenizer took


@dataclass(slots=True)
class Completions:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Completion]
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.request.status.finished for seq in self.sequences)

    def output(self, changed: set[int]) -> RequestOutput:
        """The request's output now: the completions in `changed` advanced this step (a finished
        one flushes its held-back text whether or not it advanced)."""
        completions = []
        whole = self.finished  # the final output carries each completion whole; the others, what is new
        for seq in self.sequences:
            req, detok = seq.request, seq.detokenizer
            finished = req.status.finished
            if detok is None:
                text = delta_text = ""
            else:
                delta_text = detok.take_delta(finished) if seq.index in changed or finished else ""
                text = detok.text[: detok.released] if whole else ""
            delta_ids = req.output_token_ids[seq.num_tokens_sent :]
            seq.num_tokens_sent = len(req.output_token_ids)
            delta_logprobs = req.output_logprobs[seq.num_logprobs_sent :]
            seq.num_logprobs_sent = len(req.output_logprobs)
            wants_logprobs = req.params.logprobs is not None
            completions.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=list(req.output_token_ids) if whole else [],
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                logprobs=list(req.output_logprobs) if whole and wants_logprobs else None,
                delta_logprobs=delta_logprobs,
            ))
        finished = self.finished
        prompt_logprobs = self.sequences[0].request.prompt_logprobs
        if prompt_logprobs is not None and not self.prompt_logprobs_sent and any(
                c.delta_token_ids for c in completions):
            self.prompt_logprobs_sent = True  # the prompt is computed once a token came: sent once
        else:
            prompt_logprobs = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=min(s.request.num_cached_tokens for s in self.sequences),
            phase_times=self.sequences[0].request.phase_times() if finished else None,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )


def make_detokenizer(tokenizer: Tokenizer, prompt_ids: list[int], resumed: list[int], params: SamplingParams
                     ) -> IncrementalDetokenizer | None:
    """None for a request that wants token ids only (a worker's: its router makes the text)."""
    if not params.detokenize:
        return None
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    for token in resumed:
        detokenizer.add(token)
    detokenizer.released = len(detokenizer.text)  # the text of resumed tokens went out before
    return detokenizer
