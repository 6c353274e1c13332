//! Tokens to text, off the engine thread: incremental UTF-8-safe detokenisation, stop strings
//! held back and never emitted, and logprob entries with their token strings.

use crate::generation::RawLogprob;
use crate::stop::{StopMatcher, StopOutcome};
use base::protocol::{TokenLogprob, TopLogprob};
use models::{StreamDecoder, Tokenizer};
use std::collections::VecDeque;

/// What one token turned into.
#[derive(Debug, Clone, PartialEq)]
pub struct TextPiece {
    /// Text that became final with this token (possibly empty).
    pub text: String,
    /// The logprob entries of the tokens whose text begins in `text`: an entry travels with
    /// the first chunk that carries any of its token's text, never in a chunk without text
    /// (as ollama's runner keeps `Content` and `Logprobs` aligned).
    pub logprobs: Vec<TokenLogprob>,
    /// A stop string appeared: generation should end, and `text` is what precedes it.
    pub stopped: bool,
}

pub struct TextStream {
    decoder: StreamDecoder,
    stops: StopMatcher,
    /// Bytes of text decoded so far, and of those, bytes released to the client.
    decoded: usize,
    released: usize,
    /// Logprob entries not yet released, with the byte offset where their token's text begins.
    waiting: VecDeque<(usize, TokenLogprob)>,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            decoder: StreamDecoder::new(),
            stops: StopMatcher::new(stops),
            decoded: 0,
            released: 0,
            waiting: VecDeque::new(),
        }
    }

    pub fn push(
        &mut self,
        tok: &Tokenizer,
        id: u32,
        logprob: Option<&RawLogprob>,
    ) -> models::Result<TextPiece> {
        let piece = self.decoder.push(tok, id)?;
        if let Some(l) = logprob {
            let entry = TokenLogprob {
                token: tok.token_text(id),
                logprob: l.logprob,
                top_logprobs: l
                    .top
                    .iter()
                    .map(|&(t, lp)| TopLogprob {
                        token: tok.token_text(t),
                        logprob: lp,
                    })
                    .collect(),
            };
            self.waiting.push_back((self.decoded, entry));
        }
        self.decoded += piece.len();
        Ok(match self.stops.push(&piece) {
            StopOutcome::Emit(text) => self.release(text, false),
            StopOutcome::Stopped(text) => self.release(text, true),
        })
    }

    /// Hands out `text` with the entries whose text begins in it; at the end (`last`), the
    /// entries of tokens that never reach the client (a stop string) are dropped.
    fn release(&mut self, text: String, last: bool) -> TextPiece {
        self.released += text.len();
        let mut logprobs = Vec::new();
        while let Some((start, _)) = self.waiting.front() {
            if *start >= self.released {
                break;
            }
            if let Some((_, e)) = self.waiting.pop_front() {
                logprobs.push(e);
            }
        }
        if last {
            self.waiting.clear();
        }
        TextPiece {
            text,
            logprobs,
            stopped: last,
        }
    }

    /// At the end of generation: whatever is still held back (an incomplete character, or a
    /// partial stop string that can no longer complete), stopping short of any stop string,
    /// with its logprob entries.
    pub fn finish(&mut self, tok: &Tokenizer) -> models::Result<TextPiece> {
        let tail = self.decoder.flush(tok)?;
        self.decoded += tail.len();
        let text = match self.stops.push(&tail) {
            StopOutcome::Stopped(text) => text,
            StopOutcome::Emit(text) => text + &self.stops.finish(),
        };
        let mut piece = self.release(text, true);
        piece.stopped = false;
        Ok(piece)
    }
}
