//! Tokenizer files as the model directories ship them.

use models::Tokenizer;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

#[test]
fn bos_and_eos_follow_the_config_files() {
    let g = Tokenizer::load(&fixture("gemma4_e2b_like")).unwrap();
    let ids = g.encode("Hello world").unwrap();
    assert_eq!(ids[0], 2, "gemma adds <bos>");
    assert_eq!(g.decode(&ids[1..]).unwrap(), "Hello world");
    assert_eq!(g.eos_ids(), &[1]);

    let glm = Tokenizer::load(&fixture("glm4_moe_lite")).unwrap();
    let ids = glm.encode("Hello world").unwrap();
    assert_ne!(ids[0], 2, "add_bos_token is false");
    assert_eq!(glm.decode(&ids).unwrap(), "Hello world");
    assert_eq!(glm.eos_ids(), &[1, 3], "eos_token_id as a list");
}

#[test]
fn add_bos_token_false_wins_over_a_bos_adding_post_processor() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "generation_config.json"] {
        std::fs::copy(fixture("gemma4_e2b_like").join(f), dir.path().join(f)).unwrap();
    }
    let mut tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokenizer.json")).unwrap())
            .unwrap();
    tj["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"add_bos_token": false, "bos_token": "<bos>"}"#,
    )
    .unwrap();
    let t = Tokenizer::load(dir.path()).unwrap();
    assert_ne!(t.encode("hi").unwrap()[0], 2);
    // Without the flag, the post-processor decides, and adds exactly one BOS.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": "<bos>"}"#,
    )
    .unwrap();
    let t = Tokenizer::load(dir.path()).unwrap();
    let ids = t.encode("hi").unwrap();
    assert_eq!(ids[0], 2);
    assert_ne!(ids[1], 2);
}

#[test]
fn streaming_emits_only_whole_characters() {
    let t = Tokenizer::load(&fixture("gemma4_e2b_like")).unwrap();
    let text = "héllo 世界 🎉 done";
    let ids = t.encode(text).unwrap();
    // Byte fallback splits the non-ASCII characters over several tokens.
    assert!(ids.len() > text.chars().count());
    let mut s = models::StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids[1..] {
        let piece = s.push(&t, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "emitted a broken character: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&s.flush(&t).unwrap());
    assert_eq!(out, text);
}

#[test]
fn incomplete_character_at_the_end_is_flushed() {
    let t = Tokenizer::load(&fixture("gemma4_e2b_like")).unwrap();
    let ids = t.encode("🎉").unwrap();
    let mut s = models::StreamDecoder::new();
    let mut out = String::new();
    // Drop the last byte token: the character can never complete.
    for &id in &ids[1..ids.len() - 1] {
        out.push_str(&s.push(&t, id).unwrap());
    }
    assert_eq!(
        out, "",
        "nothing is emitted while the character is incomplete"
    );
    assert!(s.flush(&t).unwrap().contains('\u{FFFD}'));
}

#[test]
fn a_byte_that_breaks_earlier_text_still_streams_sensibly() {
    // Byte-fallback tokens are 4 + byte in the fixture vocabulary: 'y' is 0x79, then a lone
    // continuation byte 0xA5 turns the decoded pair into two replacement characters.
    let t = Tokenizer::load(&fixture("glm4_moe_lite")).unwrap();
    assert_eq!(t.decode(&[4 + 0x79, 4 + 0xA5]).unwrap(), "\u{FFFD}\u{FFFD}");
    let mut s = models::StreamDecoder::new();
    assert_eq!(s.push(&t, 4 + 0x79).unwrap(), "y");
    assert_eq!(s.push(&t, 4 + 0xA5).unwrap(), "");
    assert_eq!(s.flush(&t).unwrap(), "\u{FFFD}");
}

/// Fragments random texts are made of: words, runs of spaces and newlines, tabs, digits,
/// punctuation, accents, CJK, emoji, special-token strings and long runs of one character.
const FRAGMENTS: &[&str] = &[
    "the",
    "quick",
    "brown",
    " fox",
    "jumps",
    "über",
    "naïve",
    "中文",
    "字",
    "🙂",
    "👍🏽",
    "123",
    "4567",
    "3.14",
    ",",
    ".",
    "!",
    "?",
    "'s",
    "\"",
    "(",
    ")",
    "{",
    "}",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "\t",
    "\r\n",
    "-",
    "_",
    "/",
    "http://x.y/z",
    "aaaaaaaaaaaaaaaaaaaa",
    "                    ",
    "\n\n\n\n",
    "ééééé",
    "==",
    "->",
];

fn text_of(picks: &[(usize, usize)]) -> String {
    let mut s = String::new();
    for &(f, sep) in picks {
        s.push_str(FRAGMENTS[f % FRAGMENTS.len()]);
        s.push_str(["", " ", "  ", "\n", " \n ", "\t"][sep % 6]);
    }
    s
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, failure_persistence: None, ..Default::default() })]
    /// Tokenizing in pieces gives exactly the ids of tokenizing the whole text, for both
    /// tokenizers, whatever the text (pieces of 1 KiB trusted 32 bytes from their ends).
    #[test]
    fn pieces_give_the_whole_texts_ids(
        picks in proptest::collection::vec((0usize..64, 0usize..6), 300..2500),
        margin in 16usize..64,
    ) {
        let text = text_of(&picks);
        for model in ["gemma4_e2b_like", "glm4_moe_lite"] {
            let t = Tokenizer::load(&fixture(model)).unwrap();
            let (ids, _) = t.encode_in_pieces(&text, 1024, margin).unwrap();
            proptest::prop_assert_eq!(ids, t.encode_whole(&text).unwrap(), "{}", model);
        }
    }
}

#[test]
fn long_texts_are_tokenized_in_pieces_and_joined_exactly() {
    let prose = text_of(&(0..20_000).map(|i| (i * 7 % 23, i % 6)).collect::<Vec<_>>());
    for model in ["gemma4_e2b_like", "glm4_moe_lite"] {
        let t = Tokenizer::load(&fixture(model)).unwrap();
        let (ids, pieced) = t.encode_in_pieces(&prose, 4096, 128).unwrap();
        assert!(pieced, "{model}: ordinary text joins at every piece");
        assert_eq!(ids, t.encode_whole(&prose).unwrap(), "{model}");
        assert_eq!(t.encode(&prose).unwrap(), ids, "{model}");
        // One word longer than the margin everywhere: no trusted join, tokenized whole.
        let word = "a".repeat(40_000);
        let (ids, _) = t.encode_in_pieces(&word, 4096, 128).unwrap();
        assert_eq!(ids, t.encode_whole(&word).unwrap(), "{model}");
    }
}
