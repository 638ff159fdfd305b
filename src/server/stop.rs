//! Stop sequences over streamed text: text is released only once it cannot be the start
//! of a stop sequence, and generation ends at the first one (which is not returned), as
//! OpenAI's `stop` behaves.

/// Watches generated text for any of a few stop strings.
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already released.
    released: usize,
    longest: usize,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        StopMatcher {
            stops,
            text: String::new(),
            released: 0,
            longest,
        }
    }

    /// Adds `piece`; returns the text that can be released now and the stop sequence
    /// found, if one was (the text before it is released; nothing after it ever is).
    pub fn push(&mut self, piece: &str) -> (String, Option<String>) {
        self.text.push_str(piece);
        // A match not found before ends in the new piece, so starts at most `longest - 1`
        // bytes before it.
        let mut from = self.released.saturating_sub(self.longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|at| (from + at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = found {
            let out = self.text[self.released.min(at)..at].to_string();
            self.released = self.text.len();
            return (out, Some(stop.clone()));
        }
        // Hold back the longest tail that is a proper prefix of a stop string.
        let held = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len()).filter(|&k| s.is_char_boundary(k) && self.text.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        let safe = (self.text.len() - held).max(self.released);
        let out = self.text[self.released..safe].to_string();
        self.released = safe;
        (out, None)
    }

    /// At the end of generation: whatever was held back.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.released..].to_string();
        self.released = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `pieces` and returns the released text and whether it stopped.
    fn run(stops: &[&str], pieces: &[String]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = m.push(p);
            out.push_str(&text);
            if stopped.is_some() {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    /// The reference, without holding anything back: after each piece, look for stops in
    /// everything so far and cut at the earliest-starting one found (generation stops at
    /// the first piece that completes a stop; a stop completed later cannot un-send it).
    fn reference(stops: &[&str], pieces: &[String]) -> (String, bool) {
        let mut text = String::new();
        for p in pieces {
            text.push_str(p);
            if let Some(at) = stops.iter().filter_map(|s| text.find(s)).min() {
                return (text[..at].to_string(), true);
            }
        }
        (text, false)
    }

    proptest! {
        /// However the text is split into pieces, the output is what checking the whole
        /// text after every piece gives.
        #[test]
        fn any_split_gives_the_reference_cut(
            text in "[abé\\n]{0,40}",
            stops in prop::collection::vec("[abé\\n]{1,4}", 0..4),
            cuts in prop::collection::vec(0usize..60, 0..12),
        ) {
            let chars: Vec<char> = text.chars().collect();
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (chars.len() + 1)).collect();
            bounds.push(0);
            bounds.push(chars.len());
            bounds.sort();
            bounds.dedup();
            let pieces: Vec<String> = bounds.windows(2).map(|w| chars[w[0]..w[1]].iter().collect()).collect();
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            prop_assert_eq!(run(&stops, &pieces), reference(&stops, &pieces));
        }
    }

    #[test]
    fn a_stop_split_across_pieces_is_held_back_then_dropped() {
        let mut m = StopMatcher::new(vec!["</s>".into()]);
        assert_eq!(m.push("hello <"), ("hello ".to_string(), None));
        assert_eq!(m.push("/"), (String::new(), None));
        assert_eq!(m.push("s> tail"), (String::new(), Some("</s>".into())));
    }
}
