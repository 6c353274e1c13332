//! Text in and out: `tokenizer.json` through the `tokenizers` crate, BOS handling from
//! `tokenizer_config.json`, EOS ids from `generation_config.json`, and a streaming decoder that
//! only ever emits text at UTF-8 boundaries.

use crate::config::{token_ids, JsonFile};
use crate::{ModelError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Texts longer than this are tokenized in pieces of this many bytes: the tokenizer's working
/// memory is tens of bytes per byte of text (alignments, token strings, offsets), so a 31 MiB
/// text took 3.5 GB at once.
const PIECE: usize = 256 << 10;
/// How far from a piece's ends its tokens are trusted (see [`Tokenizer::encode_in_pieces`]).
const MARGIN: usize = 4 << 10;

/// A piece's end, its ids and their absolute byte offsets.
type Piece = (usize, Vec<u32>, Vec<(usize, usize)>);

/// The largest char boundary at or before `i`.
fn char_floor(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Bytes of the longest token string in the vocabulary.
    longest: usize,
    add_bos: Option<bool>,
    bos: Option<u32>,
    eos: Vec<u32>,
}

fn special_token_id(inner: &tokenizers::Tokenizer, v: Option<&Value>) -> Option<u32> {
    let text = match v? {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content")?.as_str()?.to_string(),
        _ => return None,
    };
    inner.token_to_id(&text)
}

impl Tokenizer {
    /// Loads `tokenizer.json` plus the optional `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` of `dir` (the latter two for EOS ids).
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        Self::load_with(|name| dir.join(name))
    }

    /// The same, from a model's files wherever they are.
    pub fn load_files(files: &crate::ModelFiles) -> Result<Tokenizer> {
        Self::load_with(|name| {
            files
                .file(name)
                .map_or_else(|| files.origin.join(name), Path::to_path_buf)
        })
    }

    fn load_with(file: impl Fn(&str) -> PathBuf) -> Result<Tokenizer> {
        let path = file("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::Tokenizer {
                path,
                message: "missing".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let optional = |name: &str| JsonFile::read_optional(&file(name));
        let tcfg = optional("tokenizer_config.json")?;
        let gcfg = optional("generation_config.json")?;
        let mcfg = optional("config.json")?;
        let tval = tcfg.as_ref().map(|f| &f.value);
        let add_bos = tval
            .and_then(|v| v.get("add_bos_token"))
            .and_then(Value::as_bool);
        let bos = special_token_id(&inner, tval.and_then(|v| v.get("bos_token"))).or_else(|| {
            token_ids(gcfg.as_ref().and_then(|g| g.value.get("bos_token_id")))
                .first()
                .copied()
        });
        // EOS: generation_config first (what generation stops on), then config.json (or its
        // text_config), then the tokenizer's eos_token.
        let mut eos = token_ids(gcfg.as_ref().and_then(|g| g.value.get("eos_token_id")));
        if eos.is_empty() {
            if let Some(m) = &mcfg {
                eos = token_ids(m.value.get("eos_token_id"));
                if eos.is_empty() {
                    eos = token_ids(
                        m.value
                            .get("text_config")
                            .and_then(|t| t.get("eos_token_id")),
                    );
                }
            }
        }
        if eos.is_empty() {
            eos.extend(special_token_id(
                &inner,
                tval.and_then(|v| v.get("eos_token")),
            ));
        }
        let longest = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        Ok(Tokenizer {
            inner,
            path,
            longest,
            add_bos,
            bos,
            eos,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids for `text`, with special tokens added exactly as the tokenizer config says:
    /// the post-processor of `tokenizer.json`, corrected by `add_bos_token` when it is set.
    /// A long text is tokenized in pieces ([`Tokenizer::encode_in_pieces`]), so that its
    /// memory is bounded by the piece, not the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_in_pieces(text, PIECE, MARGIN)?.0)
    }

    /// Token ids for `text` with no special tokens at all: a piece of a prompt that follows
    /// other pieces (the text after an image).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| self.err(e))?
            .get_ids()
            .to_vec())
    }

    /// The whole text through the tokenizer at once (what [`Tokenizer::encode`] must equal).
    pub fn encode_whole(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self
            .inner
            .encode(text, true)
            .map_err(|e| self.err(e))?
            .get_ids()
            .to_vec();
        self.correct_bos(ids, || {
            Ok(self
                .inner
                .encode(text, false)
                .map_err(|e| self.err(e))?
                .get_ids()
                .first()
                .copied())
        })
    }

    /// `add_bos_token` over the post-processor's ids; `first` is the text's own first id
    /// (without special tokens), asked only when needed.
    fn correct_bos(
        &self,
        mut ids: Vec<u32>,
        first: impl FnOnce() -> Result<Option<u32>>,
    ) -> Result<Vec<u32>> {
        if let Some(bos) = self.bos {
            let starts = ids.first() == Some(&bos);
            match self.add_bos {
                Some(true) if !starts => ids.insert(0, bos),
                Some(false) if starts && first()? != Some(bos) => {
                    ids.remove(0);
                }
                _ => {}
            }
        }
        Ok(ids)
    }

    /// [`Tokenizer::encode`] with pieces of `piece` bytes trusted `margin` bytes away from
    /// their ends; also says whether the pieces were used (a text whose pieces could not be
    /// joined is tokenized whole).
    ///
    /// A tokenizer's output near a point depends only on the text near it (pre-tokenizers
    /// split words, merges stay inside them), but how far "near" reaches is the tokenizer's
    /// business, so the join is checked rather than assumed: the next piece starts about three
    /// margins before the current one ends, at one of its token boundaries, and the two are
    /// joined at a boundary both share only if they agree, token for token and offset for
    /// offset, over everything from a margin past the next piece's start to a margin before the
    /// current piece's end. Where they do not (a word longer than the margin, a tokenizer that
    /// looks further), the text is tokenized whole, as it always was.
    pub fn encode_in_pieces(
        &self,
        text: &str,
        piece: usize,
        margin: usize,
    ) -> Result<(Vec<u32>, bool)> {
        let margin = margin.max(1);
        let piece = piece.max(8 * margin);
        // Truncation or padding would apply to every piece, not to the text.
        let whole_only =
            self.inner.get_truncation().is_some() || self.inner.get_padding().is_some();
        if text.len() <= piece || whole_only {
            return Ok((self.encode_whole(text)?, false));
        }
        let Some(content) = self.pieces(text, piece, margin)? else {
            return Ok((self.encode_whole(text)?, false));
        };
        let Some((prefix, suffix)) = self.specials()? else {
            return Ok((self.encode_whole(text)?, false));
        };
        let first = content.first().copied();
        let mut ids = prefix;
        ids.extend(content);
        ids.extend(suffix);
        Ok((self.correct_bos(ids, || Ok(first))?, true))
    }

    /// What the post-processor puts before and after a text's own ids (found on a probe).
    fn specials(&self) -> Result<Option<(Vec<u32>, Vec<u32>)>> {
        let probe = "a";
        let with = self.inner.encode(probe, true).map_err(|e| self.err(e))?;
        let without = self.inner.encode(probe, false).map_err(|e| self.err(e))?;
        let (w, o) = (with.get_ids(), without.get_ids());
        if o.is_empty() || w.len() < o.len() {
            return Ok(None);
        }
        Ok(w.windows(o.len())
            .position(|x| x == o)
            .map(|i| (w[..i].to_vec(), w[i + o.len()..].to_vec())))
    }

    /// The text's own ids, piece by piece; `None` where two pieces could not be joined.
    fn pieces(&self, text: &str, piece: usize, margin: usize) -> Result<Option<Vec<u32>>> {
        // A piece's tokens with absolute byte offsets.
        let encode = |start: usize| -> Result<Piece> {
            let end = char_floor(text, (start + piece).min(text.len()));
            let e = self
                .inner
                .encode(&text[start..end], false)
                .map_err(|e| self.err(e))?;
            let offs = e
                .get_offsets()
                .iter()
                .map(|&(a, b)| (start + a, start + b))
                .collect();
            Ok((end, e.get_ids().to_vec(), offs))
        };
        // A token that starts where every token before it has ended.
        let boundary = |offs: &[(usize, usize)], j: usize| j == 0 || offs[j - 1].1 <= offs[j].0;
        let mut out = Vec::new();
        let (mut end, mut ids, mut offs) = encode(0)?;
        let mut from = 0;
        while end < text.len() {
            // The next piece's start: a boundary about three margins before this piece's end.
            let back = end - 3 * margin;
            let Some(b) = (from + 1..ids.len()).find(|&j| {
                offs[j].0 >= back && boundary(&offs, j) && text.is_char_boundary(offs[j].0)
            }) else {
                return Ok(None);
            };
            let (next_end, next_ids, next_offs) = encode(offs[b].0)?;
            // Trusted in both: from a margin into the next piece to a margin before this end.
            let (lo, hi) = (offs[b].0 + margin, end - margin);
            // Joined at the first boundary of this piece inside the trusted span, which the
            // next piece must share, and from which both must agree on every token up to `hi`
            // (any disagreement there shows the tokenizer looks further than the margin).
            let joined = (b..ids.len())
                .find(|&j| offs[j].0 >= lo && boundary(&offs, j))
                .and_then(|j| {
                    let k = next_offs.partition_point(|o| o.0 < offs[j].0);
                    if k >= next_offs.len()
                        || next_offs[k].0 != offs[j].0
                        || !boundary(&next_offs, k)
                    {
                        return None;
                    }
                    let n = offs[j..].iter().take_while(|o| o.1 <= hi).count();
                    let agree = n > 0
                        && next_ids.len() >= k + n
                        && ids[j..j + n] == next_ids[k..k + n]
                        && offs[j..j + n] == next_offs[k..k + n];
                    agree.then_some((j, k))
                });
            let Some((j, k)) = joined else {
                return Ok(None);
            };
            out.extend_from_slice(&ids[from..j]);
            (end, ids, offs, from) = (next_end, next_ids, next_offs, k);
        }
        out.extend_from_slice(&ids[from..]);
        Ok(Some(out))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }

    /// The text of one token as a client would see it in logprobs.
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id]).unwrap_or_default()
    }

    /// The `tokenizer.json` it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// An upper bound on the bytes of text that `tokens` tokens can cover, so that a text longer
    /// than that is known not to fit without tokenizing it (tokenizing megabytes costs seconds
    /// and gigabytes). A token's string in the vocabulary is at least as long as the text it
    /// stands for (byte-level and SentencePiece vocabularies spell a byte with one or more
    /// bytes); normalisation can shrink text up to about threefold (NFKC), hence the margin.
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        tokens
            .saturating_add(8)
            .saturating_mul(self.longest.max(1))
            .saturating_mul(4)
    }

    /// The first way `other` differs from this tokenizer (the size of the vocabulary, a token's
    /// string at some id, which ids are special tokens), described from `other`'s side; `None`
    /// when they map every id to the same token. A drafter proposes token ids that the target
    /// verifies, so a vocabulary that matches in size only (two ids swapped, say) would make
    /// every draft silently wrong.
    pub fn first_difference(&self, other: &Tokenizer) -> Option<String> {
        let (n, m) = (self.vocab_size(), other.vocab_size());
        if n != m {
            return Some(format!("has {m} tokens, the target's tokenizer {n}"));
        }
        for id in 0..n as u32 {
            let (a, b) = (self.inner.id_to_token(id), other.inner.id_to_token(id));
            if a != b {
                return Some(format!(
                    "maps id {id} to {}, the target's tokenizer to {}",
                    b.map_or("nothing".into(), |t| format!("{t:?}")),
                    a.map_or("nothing".into(), |t| format!("{t:?}")),
                ));
            }
        }
        let special = |t: &Tokenizer| {
            let mut v: Vec<u32> = t
                .inner
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, tok)| tok.special)
                .map(|(id, _)| id)
                .collect();
            v.sort_unstable();
            v
        };
        let (a, b) = (special(self), special(other));
        if a != b {
            let id = a
                .iter()
                .find(|i| !b.contains(i))
                .or_else(|| b.iter().find(|i| !a.contains(i)))
                .copied()
                .unwrap_or_default();
            let (draft, target) = if b.contains(&id) {
                ("treats", "does not")
            } else {
                ("does not treat", "does")
            };
            return Some(format!(
                "{draft} token {id} ({:?}) as special, the target's tokenizer {target}",
                self.inner.id_to_token(id).unwrap_or_default(),
            ));
        }
        None
    }
}

/// Incremental detokenisation: decodes a short window of recent tokens and emits only the new
/// suffix, holding text back while it ends in an incomplete UTF-8 sequence (shown as U+FFFD by
/// byte-fallback decoders) so that a character split across tokens is never emitted broken.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds a token; returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        let new = suffix_after(&now, &before);
        if !new.is_empty() && !now.ends_with('\u{FFFD}') {
            let new = new.to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(new);
        }
        Ok(String::new())
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(suffix_after(&now, &before).to_string())
    }
}

/// What `now` adds after `before`. Byte-fallback decoders can rewrite earlier text when a new
/// byte makes a run invalid (`y` then `0xA5` decodes as two replacement characters), so when
/// `now` does not extend `before` byte for byte, skip as many characters as `before` had.
fn suffix_after<'a>(now: &'a str, before: &str) -> &'a str {
    if let Some(rest) = now.strip_prefix(before) {
        return rest;
    }
    let skip = before.chars().count();
    now.char_indices().nth(skip).map_or("", |(i, _)| &now[i..])
}
