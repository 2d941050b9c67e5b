"""TokenizerRequestsMixin: the TokenizerManager's request building: tokenize, check (every field
against the model's limits and features, grammars compiled), expand n, seed; all before anything
is sent to the scheduler.
"""

from __future__ import annotations

import dataclasses
import uuid

from sglang_vericache.managers.io_struct import TokenizedGenerateReqInput
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.managers.req_state import ReqState
from sglang_vericache.managers.request_checks import check_features, check_logprob_start_len, check_prompt
from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams


class TokenizerRequestsMixin:
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this server runs with --skip-tokenizer-init: send input_ids, not text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _make_seed(self, params: SamplingParams, sample_index: int) -> int:
        if params.sampling_seed is not None:
            return (params.sampling_seed + sample_index) % 2**63
        return self.rng.getrandbits(63)

    def _build_states(self, obj: GenerateReqInput) -> list[tuple[ReqState, TokenizedGenerateReqInput]]:
        """Tokenizes and checks every prompt, expands n; raises before anything is sent."""
        built = []
        for i in range(obj.batch_size):
            text, input_ids = obj.prompt(i)
            if text is not None:
                if text == "":
                    where = "" if obj.is_single else f" (text[{i}])"
                    raise InvalidRequest(f"the prompt is empty{where}")
                input_ids = self.tokenize(text)
            params = SamplingParams.from_dict(obj.item("sampling_params", i))
            params.verify(self.vocab_size)
            check_features(params, self.limits)
            if self.grammar_backend is not None:
                self.grammar_backend.validate(params)
            check_prompt(input_ids, params.max_new_tokens, self.limits)
            return_logprob = bool(obj.item("return_logprob", i))
            start = check_logprob_start_len(obj.item("logprob_start_len", i), len(input_ids))
            top_n = obj.item("top_logprobs_num", i) or 0
            user_rid = obj.item("rid", i)
            for j in range(params.n):
                if user_rid is not None and params.n == 1:
                    rid = user_rid
                elif user_rid is not None:
                    rid = f"{user_rid}-{j}"
                else:
                    rid = uuid.uuid4().hex
                if rid in self.rid_to_state or any(s.rid == rid for s, _ in built):
                    raise InvalidRequest(f"duplicate request id: {rid}")
                state = ReqState(
                    rid=rid,
                    index=len(built),
                    stream=obj.stream,
                    params=params,
                    prompt_ids=input_ids,
                    return_logprob=return_logprob,
                    top_logprobs_num=top_n,
                    return_text_in_logprobs=obj.return_text_in_logprobs,
                    tokenizer=self.tokenizer,
                    log_metrics=obj.log_metrics,
                    no_logs=obj.no_logs,
                    return_prompt_token_ids=obj.return_prompt_token_ids,
                )
                req = TokenizedGenerateReqInput(
                    rid=rid,
                    input_ids=list(input_ids),
                    sampling_params=dataclasses.replace(params, n=1),
                    seed=self._make_seed(params, j),
                    return_logprob=return_logprob,
                    logprob_start_len=start if return_logprob else -1,
                    top_logprobs_num=top_n if return_logprob else 0,
                    stream=obj.stream,
                    input_text=text,
                )
                built.append((state, req))
        return built
