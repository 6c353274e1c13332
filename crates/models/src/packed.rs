//! Several sequences in one forward pass, packed along time (the layout vLLM and llama.cpp
//! use): `tokens: [1, T]` holds each row's tokens in turn, `T = Σ len`. Everything that acts
//! per token (embeddings, norms, projections, MLPs, experts, the head) runs once over all `T`,
//! so a decode step reads the weights once for every row; attention runs per row, at the
//! row's own offset, against the row's own caches, which are exactly the caches a lone
//! sequence has. No padding, no shared ring position: every cache kind (growing, rotating,
//! latent, KV-shared) batches as it is, and each row rewinds on its own.

use crate::{ModelError, Result};
use cache::LayerCache;
use mlx::Array;

/// One sequence of a packed forward: how many of the packed tokens are its, its caches, and
/// the media whose soft tokens take the place of some of its tokens.
pub struct PackedRow<'a> {
    /// The sequence the row belongs to, unique while it lives (0: a row for this pass only,
    /// whose caches are not kept): what a replica of the model on another rank keeps the row's
    /// caches under.
    pub seq: u64,
    pub len: usize,
    pub caches: &'a mut [LayerCache],
    pub media: &'a [MediaSpan],
}

impl<'a> PackedRow<'a> {
    /// A row of text tokens only.
    pub fn text(len: usize, caches: &'a mut [LayerCache]) -> PackedRow<'a> {
        PackedRow {
            seq: 0,
            len,
            caches,
            media: &[],
        }
    }
}

/// Soft tokens of one media item (an image's encoded patches, a clip's encoded frames) inside a
/// packed row: `embeds` (`[n, hidden]`) replace the embeddings of the row's tokens `at..at + n`
/// of this pass (the placeholder tokens the prompt holds for it). Where the model's image tokens
/// see each other both ways (gemma4's `use_bidirectional_attention: "vision"`), an image must be
/// whole in one pass: a pass cannot know about keys a later pass brings. Audio is causal.
#[derive(Clone)]
pub struct MediaSpan {
    pub at: usize,
    pub embeds: Array,
    pub kind: MediaKind,
}

/// What a media item is: the model's attention rule over its tokens depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MediaKind {
    Image,
    Audio,
}

impl MediaSpan {
    pub fn len(&self) -> usize {
        self.embeds.shape().first().map_or(0, |&n| n as usize)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The time length of a single-row `[1, L]` token array.
pub(crate) fn single_row(tokens: &Array) -> Result<usize> {
    match tokens.shape()[..] {
        [1, l] => Ok(l as usize),
        ref s => Err(ModelError::Invalid(format!(
            "tokens of shape {s:?}: a forward takes one row [1, L] (several sequences go through forward_packed)"
        ))),
    }
}

/// Checks a packed batch: `[1, Σ len]` tokens, rows of at least one token, each with the
/// caches the model makes.
pub(crate) fn check_rows(
    tokens: &Array,
    rows: &[PackedRow<'_>],
    caches: usize,
    model: &str,
) -> Result<()> {
    let total: usize = rows.iter().map(|r| r.len).sum();
    let t = single_row(tokens)?;
    if rows.is_empty() || t != total || rows.iter().any(|r| r.len == 0) {
        return Err(ModelError::Invalid(format!(
            "a packed forward of {t} tokens for rows of {:?} tokens",
            rows.iter().map(|r| r.len).collect::<Vec<_>>()
        )));
    }
    if let Some(r) = rows.iter().find(|r| r.caches.len() != caches) {
        return Err(ModelError::Invalid(format!(
            "{model} needs {caches} layer caches per row, got {}",
            r.caches.len()
        )));
    }
    for r in rows {
        let mut end = 0;
        for m in r.media {
            if m.at < end || m.at + m.len() > r.len || m.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "media of {} tokens at {} in a row of {} tokens (after {end})",
                    m.len(),
                    m.at,
                    r.len
                )));
            }
            end = m.at + m.len();
        }
    }
    Ok(())
}
