//! Modelfiles from outside: any text parses or is refused with a message naming the line,
//! never a panic.

use proptest::prelude::*;
use store::Modelfile;

fn line() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        Just("FROM".to_string()),
        Just("DRAFT".to_string()),
        Just("PARAMETER".to_string()),
        Just("TEMPLATE".to_string()),
        Just("SYSTEM".to_string()),
        Just("MESSAGE".to_string()),
        Just("LICENSE".to_string()),
        Just("ADAPTER".to_string()),
        Just("from".to_string()),
        "[a-z_]{0,12}",
    ];
    let arg = prop_oneof![
        Just("./model".to_string()),
        Just("temperature 0.7".to_string()),
        Just("num_ctx -5".to_string()),
        Just("repeat_last_n 99999999999999999999".to_string()),
        Just("stop \"<|end|>\"".to_string()),
        Just("top_p NaN".to_string()),
        Just("\"\"\"".to_string()),
        Just("user hello".to_string()),
        ".{0,24}",
    ];
    (word, arg).prop_map(|(w, a)| format!("{w} {a}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_text(text in "(?s).{0,200}") {
        let _ = text.parse::<Modelfile>();
    }

    #[test]
    fn modelfile_like_text(lines in prop::collection::vec(line(), 0..8)) {
        let text = lines.join("\n");
        if let Err(e) = text.parse::<Modelfile>() {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}
