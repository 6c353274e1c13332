//! Media in a prompt, prepared on the HTTP side (off the engine thread): the `[img-N]` tags
//! ollama's parent writes into the prompt (for images and audio alike) are matched with the
//! request's media items; each image is decoded and cut into patches by the model's image
//! processor, each clip decoded, resampled and turned into log-mel frames by its feature
//! extractor; the prompt becomes token ids with each tag replaced by the item's begin token, one
//! placeholder per soft token, its end token (docs/PROTOCOL.md, "Media").

use crate::generation::PromptMedia;
use base::protocol::{audio_kind, MediaItem};
use models::gemma4_audio_features::prepare_audio;
use models::media::{MediaInput, MediaPrompt};
use models::Tokenizer;
use std::sync::Arc;

/// The most media items (images and clips) one prompt may hold.
pub const MAX_MEDIA: usize = 16;

/// A piece of a prompt: text, or the id an `[img-N]` tag names.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Image(i64),
}

/// The prompt cut at its `[img-N]` tags (N a non-negative integer; anything else is text).
fn pieces(prompt: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut rest = prompt;
    let mut text_start = 0;
    let mut at = 0;
    while let Some(i) = rest[at..].find("[img-") {
        let tag = at + i;
        let digits = &rest[tag + 5..];
        let n = digits.bytes().take_while(u8::is_ascii_digit).count();
        let closes = digits.as_bytes().get(n) == Some(&b']');
        match digits[..n].parse::<i64>() {
            Ok(id) if n > 0 && closes => {
                out.push(Piece::Text(&rest[text_start..tag]));
                out.push(Piece::Image(id));
                rest = &rest[tag + 5 + n + 1..];
                text_start = 0;
                at = 0;
            }
            _ => at = tag + 5,
        }
    }
    out.push(Piece::Text(&rest[text_start..]));
    out
}

/// The prompt's token ids and its media, for a model that takes media (`media`). Every tag
/// must name an item and every item must be named; each item is decoded and prepared for its
/// tower here (the expensive part: call it off the async threads).
pub fn prepare(
    tok: &Tokenizer,
    media: &MediaPrompt,
    prompt: &str,
    items: &[MediaItem],
) -> Result<(Vec<u32>, Vec<PromptMedia>), String> {
    let pieces = pieces(prompt);
    let tags = pieces
        .iter()
        .filter(|p| matches!(p, Piece::Image(_)))
        .count();
    if tags > MAX_MEDIA {
        return Err(format!(
            "the prompt holds {tags} media items, more than the {MAX_MEDIA} a prompt may hold"
        ));
    }
    for item in items {
        if !pieces.contains(&Piece::Image(item.id)) {
            return Err(format!(
                "media item {} is not named in the prompt (no [img-{}] tag)",
                item.id, item.id
            ));
        }
    }
    let mut ids = Vec::new();
    let mut out = Vec::new();
    // An item named twice is prepared once.
    let mut prepared: Vec<(i64, Arc<MediaInput>, u32)> = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        match *piece {
            Piece::Text(t) if i == 0 => ids.extend(tok.encode(t).map_err(|e| e.to_string())?),
            Piece::Text(t) => ids.extend(tok.encode_plain(t).map_err(|e| e.to_string())?),
            Piece::Image(id) => {
                let item = items.iter().find(|m| m.id == id).ok_or_else(|| {
                    format!("the prompt names [img-{id}], but no media item has the id {id}")
                })?;
                let (input, fold) = match prepared.iter().find(|(k, ..)| *k == id) {
                    Some((_, p, f)) => (Arc::clone(p), *f),
                    None => {
                        let (p, f) = prepare_item(media, id, &item.data)?;
                        let p = Arc::new(p);
                        prepared.push((id, Arc::clone(&p), f));
                        (p, f)
                    }
                };
                let (open, token, close, len) = match &*input {
                    MediaInput::Image(p) => {
                        let images = media.images.as_ref().expect("prepared as an image");
                        let k = images.processor.pooling_kernel_size;
                        let len = ((p.grid.0 / k) * (p.grid.1 / k)) as usize;
                        (images.boi, images.image_token, images.eoi, len)
                    }
                    MediaInput::Audio(f) => {
                        let audio = media.audio.as_ref().expect("prepared as audio");
                        (
                            audio.boa,
                            audio.audio_token,
                            audio.eoa,
                            audio.soft_tokens(f.frames),
                        )
                    }
                };
                ids.push(open);
                out.push(PromptMedia {
                    at: ids.len(),
                    len,
                    fold,
                    input,
                });
                ids.extend(std::iter::repeat_n(token, len));
                ids.push(close);
            }
        }
    }
    Ok((ids, out))
}

/// One item decoded and prepared for its tower, and its fold value; `Err` says what is wrong
/// with it, naming it.
fn prepare_item(media: &MediaPrompt, id: i64, data: &[u8]) -> Result<(MediaInput, u32), String> {
    if let Some(kind) = audio_kind(data) {
        let Some(audio) = &media.audio else {
            return Err(format!(
                "media item {id} is {kind} audio: this model does not take audio"
            ));
        };
        let fx = audio.features.extractor();
        let (features, _) =
            prepare_audio(data, &fx).map_err(|e| format!("media item {id}: {e}"))?;
        let tokens = models::gemma4_audio::AudioConfig::soft_tokens(features.frames);
        if tokens > audio.max_tokens {
            return Err(format!(
                "media item {id}: the clip makes {tokens} audio tokens, more than the {} one clip may take",
                audio.max_tokens
            ));
        }
        let fold = fold(data, &[features.frames as i32, features.mel as i32]);
        return Ok((MediaInput::Audio(features), fold));
    }
    let Some(images) = &media.images else {
        return Err(format!(
            "media item {id} is not audio, and this model does not take images"
        ));
    };
    let p = images
        .processor
        .preprocess(data)
        .map_err(|e| format!("media item {id}: {e}"))?;
    let fold = fold(data, &[p.grid.0, p.grid.1]);
    Ok((MediaInput::Image(p), fold))
}

/// What the prefix cache keys an item's positions by: FNV-1a (64-bit) over its bytes and its
/// prepared dimensions (an image's patch grid, a clip's frames and bins: they fix its soft
/// tokens for given bytes), folded to 32 bits, with bit 31 set so that it is never a token id
/// (ollama's runner keys its media the same way).
fn fold(data: &[u8], dims: &[i32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    data.iter().copied().for_each(&mut eat);
    for &d in dims {
        (d as u64).to_le_bytes().into_iter().for_each(&mut eat);
    }
    ((h >> 32) as u32 ^ h as u32) | 1 << 31
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_split_the_prompt() {
        use Piece::*;
        assert_eq!(
            pieces("a [img-0] b[img-12]"),
            vec![Text("a "), Image(0), Text(" b"), Image(12), Text("")]
        );
        assert_eq!(pieces("[img-3]"), vec![Text(""), Image(3), Text("")]);
        // Not tags: text.
        assert_eq!(
            pieces("[img-] [img-x] [img-1"),
            vec![Text("[img-] [img-x] [img-1")]
        );
        assert_eq!(
            pieces("[img-[img-2]"),
            vec![Text("[img-"), Image(2), Text("")]
        );
    }
}
