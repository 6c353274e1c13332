//! Stop strings matched across token boundaries and never emitted.

/// Buffers generated text and releases only what can no longer become part of a stop string.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that is final; generation goes on.
    Emit(String),
    /// A stop string appeared: this text precedes it, and generation ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        // The earliest stop string wins.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            let before = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(before);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome::Emit(out)
    }

    /// The held-back text, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`, on
/// character boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.is_char_boundary(n) && text[start..] == stop[..n]
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Emit(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_tokens_is_not_emitted() {
        assert_eq!(
            run(&["\n\n"], &["Hello", "\n", "\nworld"]),
            ("Hello".into(), true)
        );
        assert_eq!(
            run(&["END"], &["abc E", "N", "D more"]),
            ("abc ".into(), true)
        );
        assert_eq!(
            run(&["END"], &["abc E", "N", "x"]),
            ("abc ENx".into(), false)
        );
    }

    #[test]
    fn earliest_stop_wins_and_text_before_is_kept() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a"]), ("a".into(), false));
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }

    #[test]
    fn held_text_is_released_once_it_cannot_match() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("xST"), StopOutcome::Emit("x".into()));
        assert_eq!(m.push("y"), StopOutcome::Emit("STy".into()));
    }
}
