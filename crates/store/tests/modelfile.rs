//! The Modelfile parser: every command, quoting, and errors that name their line.

use serde_json::json;
use std::path::Path;
use store::modelfile::{resolve, Source};
use store::Modelfile;

fn parse(text: &str) -> Modelfile {
    text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn error(text: &str) -> (usize, String) {
    let e = text.parse::<Modelfile>().expect_err(text);
    (e.line, e.message)
}

#[test]
fn every_command() {
    let m = parse(
        r#"# a comment
FROM ./gemma
  draft   ../assistant
PARAMETER temperature 0.7
parameter TOP_K 40
PARAMETER top_p 0.9
PARAMETER min_p 0.05
PARAMETER num_ctx 4096
PARAMETER num_predict -1
PARAMETER repeat_penalty 1.1
PARAMETER repeat_last_n 64
PARAMETER presence_penalty -0.5
PARAMETER frequency_penalty 0.25
PARAMETER seed -7
PARAMETER num_keep 4
PARAMETER stop "<end_of_turn>"
PARAMETER stop </s>
TEMPLATE {{ .Prompt }}
SYSTEM "Be \"brief\".\tOK\\"
MESSAGE user "Hi there"
MESSAGE Assistant Hello!
LICENSE """MIT
second line"""
LICENSE Apache-2.0
"#,
    );
    assert_eq!(m.from.as_ref().unwrap().value, "./gemma");
    assert_eq!(m.from.as_ref().unwrap().line, 2);
    assert_eq!(m.draft.as_ref().unwrap().value, "../assistant");
    assert_eq!(m.draft.as_ref().unwrap().line, 3);
    let p = &m.parameters;
    assert_eq!(p["temperature"], json!(0.7));
    assert_eq!(p["top_k"], json!(40));
    assert_eq!(p["top_p"], json!(0.9));
    assert_eq!(p["min_p"], json!(0.05));
    assert_eq!(p["num_ctx"], json!(4096));
    assert_eq!(p["num_predict"], json!(-1));
    assert_eq!(p["repeat_penalty"], json!(1.1));
    assert_eq!(p["repeat_last_n"], json!(64));
    assert_eq!(p["presence_penalty"], json!(-0.5));
    assert_eq!(p["frequency_penalty"], json!(0.25));
    assert_eq!(p["seed"], json!(-7));
    assert_eq!(p["num_keep"], json!(4));
    assert_eq!(p["stop"], json!(["<end_of_turn>", "</s>"]));
    assert_eq!(m.template.as_deref(), Some("{{ .Prompt }}"));
    assert_eq!(m.system.as_deref(), Some("Be \"brief\".\tOK\\"));
    assert_eq!(m.messages.len(), 2);
    assert_eq!(
        (m.messages[0].role.as_str(), m.messages[0].content.as_str()),
        ("user", "Hi there")
    );
    assert_eq!(
        (m.messages[1].role.as_str(), m.messages[1].content.as_str()),
        ("assistant", "Hello!")
    );
    assert_eq!(m.license, vec!["MIT\nsecond line", "Apache-2.0"]);
}

#[test]
fn multi_line_strings_keep_their_text_exactly() {
    let m = parse("FROM x\nTEMPLATE \"\"\"\n{{ if .System }}<sys>{{ .System }}\n  indented \"quoted\" \\n raw\n\"\"\"\nSYSTEM \"\"\"one line\"\"\"  # trailing comment\n");
    assert_eq!(
        m.template.as_deref(),
        Some("\n{{ if .System }}<sys>{{ .System }}\n  indented \"quoted\" \\n raw\n")
    );
    assert_eq!(m.system.as_deref(), Some("one line"));
}

#[test]
fn the_canonical_form_parses_back_to_the_same_modelfile() {
    let m = parse(
        "FROM \"./a dir/with spaces\"\nDRAFT d\nPARAMETER stop \"a\\\"b\"\nPARAMETER stop x\nPARAMETER temperature 0.5\nTEMPLATE \"\"\"multi\nline \"\"\"\nSYSTEM \"ends with a quote\\\"\"\nMESSAGE system \"tab\\there\"\nLICENSE \"L1\"\n",
    );
    assert_eq!(m.from.as_ref().unwrap().value, "./a dir/with spaces");
    let again: Modelfile = m.to_string().parse().unwrap();
    let strip = |mut m: Modelfile| {
        m.from.as_mut().unwrap().line = 0;
        m.draft.as_mut().unwrap().line = 0;
        m
    };
    assert_eq!(strip(again), strip(m));
}

#[test]
fn errors_name_the_line_and_what_was_expected() {
    let cases: &[(&str, usize, &str)] = &[
        (
            "FROM x\nFORM y",
            2,
            "unknown command \"FORM\" (expected FROM, DRAFT",
        ),
        (
            "FROM x\n\n# c\nPARAMETER temprature 1",
            4,
            "unknown parameter \"temprature\"",
        ),
        (
            "FROM x\nPARAMETER top_k many",
            2,
            "parameter top_k expects an integer, got \"many\"",
        ),
        (
            "FROM x\nPARAMETER temperature hot",
            2,
            "parameter temperature expects a number",
        ),
        (
            "FROM x\nPARAMETER top_p 1.5",
            2,
            "parameter top_p must be between 0 and 1, got 1.5",
        ),
        (
            "FROM x\nPARAMETER temperature -1",
            2,
            "parameter temperature must be at least 0",
        ),
        (
            "FROM x\nPARAMETER num_ctx 0",
            2,
            "parameter num_ctx must be at least 1, got 0",
        ),
        ("FROM x\nPARAMETER", 2, "PARAMETER needs a name and a value"),
        ("FROM x\nPARAMETER seed", 2, "PARAMETER seed needs a value"),
        (
            "FROM x\nSYSTEM \"open",
            2,
            "the quoted value of SYSTEM is never closed",
        ),
        (
            "FROM x\nTEMPLATE \"\"\"a\nb\nc",
            2,
            "the \"\"\" string of TEMPLATE is never closed",
        ),
        (
            "FROM x\nSYSTEM \"a\" b",
            2,
            "unexpected \"b\" after the closing quote",
        ),
        (
            "FROM x\nSYSTEM \"\"\"a\nb\"\"\" junk",
            3,
            "unexpected \"junk\" after the closing \"\"\"",
        ),
        (
            "FROM x\nMESSAGE bot hi",
            2,
            "MESSAGE needs a role (system, user or assistant)",
        ),
        ("FROM x\nMESSAGE user", 2, "MESSAGE needs a value"),
        (
            "FROM x\nFROM y",
            2,
            "a second FROM (the first is on line 1)",
        ),
        (
            "FROM x\nDRAFT a\nDRAFT b",
            3,
            "a second DRAFT (the first is on line 2)",
        ),
        ("FROM", 1, "FROM needs a value"),
        ("FROM x\nADAPTER ./lora", 2, "ADAPTER is not supported"),
        ("# only a comment\nSYSTEM hi", 2, "no FROM line"),
        ("", 1, "no FROM line"),
    ];
    for (text, line, message) in cases {
        let (l, m) = error(text);
        assert_eq!(l, *line, "{text:?}: {m}");
        assert!(m.contains(message), "{text:?}: {m:?} lacks {message:?}");
    }
}

#[test]
fn paths_are_relative_to_the_modelfile_and_names_are_names() {
    let base = tempfile::tempdir().unwrap();
    std::fs::create_dir(base.path().join("gemma")).unwrap();
    assert_eq!(
        resolve(base.path(), "gemma"),
        Source::Dir(base.path().join("gemma"))
    );
    assert_eq!(
        resolve(base.path(), "./missing"),
        Source::Dir(base.path().join("./missing"))
    );
    assert_eq!(
        resolve(Path::new("/x"), "/abs/dir"),
        Source::Dir("/abs/dir".into())
    );
    assert_eq!(
        resolve(base.path(), "library/gemma4:e2b"),
        Source::Name("library/gemma4:e2b".into())
    );
    if let Some(home) = std::env::var_os("HOME") {
        assert_eq!(
            resolve(base.path(), "~/m"),
            Source::Dir(Path::new(&home).join("m"))
        );
    }
}
