//! Images in a prompt, prepared on the HTTP side (off the engine thread): the `[img-N]` tags
//! ollama's parent writes into the prompt are matched with the request's media items, each image
//! is decoded and cut into patches by the model's image processor, and the prompt becomes token
//! ids with each tag replaced by `boi`, one image token per soft token, `eoi`
//! (docs/PROTOCOL.md, "Media").

use crate::generation::PromptImage;
use base::protocol::MediaItem;
use models::gemma4_vision::ImagePrompt;
use models::Tokenizer;
use std::sync::Arc;

/// The most images one prompt may hold.
pub const MAX_IMAGES: usize = 16;

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

/// The prompt's token ids and its images, for a model that takes images (`images`). Every tag
/// must name an item and every item must be named; each image is decoded and cut into patches
/// here (the expensive part: call it off the async threads).
pub fn prepare(
    tok: &Tokenizer,
    images: &ImagePrompt,
    prompt: &str,
    items: &[MediaItem],
) -> Result<(Vec<u32>, Vec<PromptImage>), String> {
    let pieces = pieces(prompt);
    let tags = pieces
        .iter()
        .filter(|p| matches!(p, Piece::Image(_)))
        .count();
    if tags > MAX_IMAGES {
        return Err(format!(
            "the prompt holds {tags} images, more than the {MAX_IMAGES} a prompt may hold"
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
    let mut media = Vec::new();
    let mut patches: Vec<(i64, Arc<models::gemma4_vision::ImagePatches>)> = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        match *piece {
            Piece::Text(t) if i == 0 => ids.extend(tok.encode(t).map_err(|e| e.to_string())?),
            Piece::Text(t) => ids.extend(tok.encode_plain(t).map_err(|e| e.to_string())?),
            Piece::Image(id) => {
                let item = items.iter().find(|m| m.id == id).ok_or_else(|| {
                    format!("the prompt names [img-{id}], but no media item has the id {id}")
                })?;
                if let Some(kind) = audio_kind(&item.data) {
                    return Err(format!(
                        "media item {id} is {kind} audio: this runner does not take audio yet"
                    ));
                }
                let p = match patches.iter().find(|(k, _)| *k == id) {
                    Some((_, p)) => Arc::clone(p),
                    None => {
                        let p = images
                            .processor
                            .preprocess(&item.data)
                            .map_err(|e| format!("media item {id}: {e}"))?;
                        let p = Arc::new(p);
                        patches.push((id, Arc::clone(&p)));
                        p
                    }
                };
                let k = images.processor.pooling_kernel_size;
                let len = ((p.grid.0 / k) * (p.grid.1 / k)) as usize;
                ids.push(images.boi);
                media.push(PromptImage {
                    at: ids.len(),
                    len,
                    fold: fold(&item.data, &p),
                    patches: p,
                });
                ids.extend(std::iter::repeat_n(images.image_token, len));
                ids.push(images.eoi);
            }
        }
    }
    Ok((ids, media))
}

/// The audio format `data` is in, by its first bytes (ollama's parent sends audio as media
/// too): WAV, MP3 (an ID3 tag or a frame header), FLAC or Ogg.
fn audio_kind(data: &[u8]) -> Option<&'static str> {
    match data {
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => Some("WAV"),
        [b'I', b'D', b'3', ..] | [0xFF, 0xE0..=0xFF, ..] => Some("MP3"),
        [b'f', b'L', b'a', b'C', ..] => Some("FLAC"),
        [b'O', b'g', b'g', b'S', ..] => Some("Ogg"),
        _ => None,
    }
}

/// What the prefix cache keys an image's positions by: FNV-1a (64-bit) over its bytes and its
/// patch grid (which fixes its soft tokens for given bytes), folded to 32 bits, with bit 31 set
/// so that it is never a token id (ollama's runner keys its media the same way).
fn fold(data: &[u8], p: &models::gemma4_vision::ImagePatches) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    data.iter().copied().for_each(&mut eat);
    for d in [p.grid.0, p.grid.1] {
        (d as u64).to_le_bytes().into_iter().for_each(&mut eat);
    }
    ((h >> 32) as u32 ^ h as u32) | 1 << 31
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audio_is_told_apart_from_images() {
        assert_eq!(audio_kind(b"RIFF\x24\0\0\0WAVEfmt "), Some("WAV"));
        assert_eq!(audio_kind(b"ID3\x04\0"), Some("MP3"));
        assert_eq!(audio_kind(&[0xFF, 0xFB, 0x90, 0x00]), Some("MP3"));
        assert_eq!(audio_kind(b"fLaC\0"), Some("FLAC"));
        // JPEG starts 0xFF 0xD8: an image.
        assert_eq!(audio_kind(&[0xFF, 0xD8, 0xFF, 0xE0]), None);
        assert_eq!(audio_kind(b"\x89PNG\r\n"), None);
    }

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
