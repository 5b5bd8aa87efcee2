//! Mid-stream migration, the pure part: no I/O, synchronous.
//!
//! When a stream breaks after generation started, the proxy re-sends the
//! request to another worker with what the client already got appended
//! (and the token budget reduced), and splices the new worker's events on,
//! so the client reads one unbroken stream. A non-streaming request is sent
//! upstream as a stream and assembled, so it can be continued the same way.
//!
//! The pieces, in the order the proxy uses them:
//!
//! - [`Sent::read`]: what the client has been sent, read (only after a
//!   break, never on the happy path) from the whole events forwarded so far;
//! - [`continuation()`]: the request body that continues it on another
//!   worker, or why that would not be faithful ([`NotResumable`]);
//! - [`Splicer`]: rewrites the continuing worker's events so they read as
//!   the rest of the client's stream (ids, role, usage, `/generate`'s
//!   cumulative text and ids);
//! - [`as_stream`] and [`Assembler`]: a non-streaming request sent as a
//!   stream, and its events built back into the answer the engine would
//!   have sent;
//! - [`is_error_event`]: an event carrying an engine's error mid-stream
//!   (vLLM and SGLang send one instead of closing), which the caller treats
//!   as a break.
//!
//! A second break is handled like the first: [`Sent::read`] over every
//! event the client got (the spliced ones included), [`continuation()`] of
//! the client's own body (not of the first continuation), a new
//! [`Splicer`].
//!
//! What is assumed of the engines (vLLM, SGLang):
//!
//! - one choice per stream (`n > 1` and batches are refused);
//! - a chat or completion chunk whose `content` / `text` is not empty
//!   carries one token (unless the stream reports
//!   `usage.completion_tokens` on its chunks, which then wins);
//! - `/generate` streams cumulative `text` and `output_ids` (SGLang's
//!   default, not `--incremental-streaming-output`);
//! - chat engines take `continue_final_message` and `add_generation_prompt`
//!   (both vLLM and SGLang do);
//! - unset limits: completions' `max_tokens` is 16 and `/generate`'s
//!   `max_new_tokens` 128 (both engines' defaults); chat has none.
//!
//! Continuing from text is faithful in the text, not always in the tokens:
//! the engine re-tokenizes the sent text, which may split differently at
//! the boundary, and a stop string straddling the break is not seen. A
//! `/generate` request given as `input_ids` continues from the exact ids.

mod assemble;
mod continuation;
mod events;
mod raw;
mod sent;
mod splice;
#[cfg(test)]
mod tests;

// The error type is named only by callers that match on it.
#[allow(unused_imports)]
pub(crate) use assemble::AssembleError;
pub(crate) use assemble::Assembler;
pub(crate) use continuation::{as_stream, continuation};
pub(crate) use events::is_error_event;
pub(crate) use sent::Sent;
pub(crate) use splice::Splicer;

/// Which generation API a request is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Api {
    /// OpenAI `POST /v1/chat/completions`.
    Chat,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// SGLang `POST /generate`.
    Generate,
}

impl Api {
    /// The API served at `path`; `None` for any other path.
    pub(crate) fn from_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/generate" => Some(Api::Generate),
            _ => None,
        }
    }
}

/// Why a request cannot be continued on another worker, or a non-streaming
/// one assembled from a stream, faithfully. The caller then does what it
/// did before migration existed: ends the stream with an error event, or
/// sends the request as it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NotResumable {
    /// The request body is not a JSON object (or `/generate`'s
    /// `sampling_params` is neither an object nor absent).
    #[error("the request body is not a JSON object")]
    BodyNotJson,
    /// The request asks for several answers in one response: `n > 1`,
    /// `best_of > 1` (`sampling_params.n > 1` on `/generate`), or a batch
    /// (a completions `prompt` list of several prompts; a `/generate`
    /// `text` list, `input_ids` list of lists or `sampling_params` list).
    #[error("the request asks for several answers (n, best_of or a batch)")]
    SeveralChoices,
    /// The request asks for log probabilities (chat `logprobs: true`,
    /// completions `logprobs` set, `prompt_logprobs` set, `/generate`
    /// `return_logprob: true`): the part already sent would be missing
    /// from a continuation's, and assembling them is not supported.
    #[error("the request asks for log probabilities")]
    Logprobs,
    /// The generation is constrained by a grammar (`response_format` other
    /// than `text`; `guided_json`, `guided_regex`, `guided_choice`,
    /// `guided_grammar`, `structured_outputs`, `structural_tag`, `regex`,
    /// `json_schema` or `ebnf`, at the top level or in `/generate`'s
    /// `sampling_params`; a `tool_choice` of `required` or a named
    /// function): a continuation would restart the grammar mid-answer.
    /// Assembling is not affected.
    #[error("the generation is constrained by a grammar")]
    GuidedDecoding,
    /// `echo: true`: the answer starts with the prompt.
    #[error("the request asks for the prompt echoed")]
    Echo,
    /// The prompt cannot have the sent text appended: a completions prompt
    /// that is not one string (token ids), `/generate` with neither `text`
    /// nor `input_ids` (or both), a chat body without a `messages` list, a
    /// continued final message whose content is not a string, or
    /// `add_generation_prompt: false` without `continue_final_message`.
    #[error("the prompt cannot have the sent text appended")]
    PromptNotText,
    /// A `/generate` prompt given as `input_ids`, but the stream did not
    /// report the ids it generated (`output_ids`), all of them.
    #[error("the stream did not report the token ids it generated")]
    OutputIdsMissing,
    /// A token limit the continuation must reduce (`max_tokens`,
    /// `max_completion_tokens`, `max_new_tokens`) is not a non-negative
    /// integer.
    #[error("a token limit is not a non-negative integer")]
    InvalidTokenLimit,
    /// The partial answer holds tool-call deltas: a continuation would
    /// have to rebuild the call from text the engine's parser consumed.
    #[error("the partial answer holds tool calls")]
    ToolCallsStreamed,
    /// The partial answer holds reasoning deltas (`reasoning_content`,
    /// `reasoning`), which a continued assistant message cannot carry
    /// faithfully across chat templates.
    #[error("the partial answer holds reasoning")]
    ReasoningStreamed,
    /// The stream had finished (a `finish_reason` or `[DONE]` was sent):
    /// there is nothing to continue.
    #[error("the stream had already finished")]
    Finished,
    /// No token of the budget is left: the stream was in fact over.
    #[error("no token of the budget is left")]
    BudgetSpent,
}

impl NotResumable {
    /// A snake_case label for metrics.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            NotResumable::BodyNotJson => "body_not_json",
            NotResumable::SeveralChoices => "several_choices",
            NotResumable::Logprobs => "logprobs",
            NotResumable::GuidedDecoding => "guided_decoding",
            NotResumable::Echo => "echo",
            NotResumable::PromptNotText => "prompt_not_text",
            NotResumable::OutputIdsMissing => "output_ids_missing",
            NotResumable::InvalidTokenLimit => "invalid_token_limit",
            NotResumable::ToolCallsStreamed => "tool_calls_streamed",
            NotResumable::ReasoningStreamed => "reasoning_streamed",
            NotResumable::Finished => "finished",
            NotResumable::BudgetSpent => "budget_spent",
        }
    }
}
