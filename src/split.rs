//! Splitting a reply into chunks that fit a platform's message limit.
//!
//! Cuts prefer, in order, a paragraph break, a line break, the end of a sentence and a
//! space, looking in the last half of the room a chunk has; only a text with none of
//! those is cut between two grapheme clusters. A grapheme cluster (an emoji with its
//! modifiers, a letter with its combining marks) is never cut. A fenced code block that
//! a cut falls into is closed at the end of the chunk and reopened, with the same fence
//! and language tag, at the start of the next, so every chunk renders as code.

use std::ops::Range;

use unicode_segmentation::UnicodeSegmentation;

use crate::error::{Error, Result};

/// How a platform counts the length of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LengthUnit {
    /// UTF-8 bytes.
    Bytes,
    /// Unicode scalar values (Rust `char`s).
    Chars,
    /// UTF-16 code units (JavaScript string length; what Telegram and LINE count).
    Utf16,
}

impl LengthUnit {
    /// The length of `s` in this unit.
    pub fn len(self, s: &str) -> usize {
        match self {
            LengthUnit::Bytes => s.len(),
            LengthUnit::Chars => s.chars().count(),
            LengthUnit::Utf16 => s.chars().map(char::len_utf16).sum(),
        }
    }

    /// Whether `s` is at most `max` long, reading no further than needed.
    fn fits(self, s: &str, max: usize) -> bool {
        match self {
            LengthUnit::Bytes => s.len() <= max,
            LengthUnit::Chars | LengthUnit::Utf16 => {
                if s.len() <= max {
                    return true; // never more chars or UTF-16 units than bytes
                }
                let mut used = 0;
                s.chars().all(|c| {
                    used += if self == LengthUnit::Chars {
                        1
                    } else {
                        c.len_utf16()
                    };
                    used <= max
                })
            }
        }
    }
}

/// Splits text into chunks of at most `limit` units.
///
/// ```
/// use chunked_outbox::Splitter;
/// use chunked_outbox::split::LengthUnit;
///
/// let splitter = Splitter::new(20, LengthUnit::Chars)?;
/// let chunks = splitter.split("First paragraph.\n\nSecond one, a bit longer.")?;
/// assert_eq!(chunks, ["First paragraph.\n\n", "Second one, a bit ", "longer."]);
/// # Ok::<(), chunked_outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Splitter {
    limit: usize,
    unit: LengthUnit,
    markup: Markup,
}

/// The markup a text carries, which a cut must not break.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Markup {
    /// Plain text or Markdown (the default): a fenced code block that a cut falls into
    /// is closed at the end of the chunk and reopened, with its language tag, at the
    /// start of the next.
    #[default]
    Markdown,
    /// Telegram's `parse_mode: "HTML"`: a cut never falls inside a tag or a character
    /// entity (`&amp;`), and the tags open at a cut (`<b>`, `<i>`, `<a href=...>`,
    /// `<pre><code class=...>`, `<blockquote>` ...) are closed at the end of the chunk and
    /// reopened, attributes and all, at the start of the next — so every chunk parses on
    /// its own and keeps its formatting.
    TelegramHtml,
}

impl Splitter {
    /// A splitter for `limit` units of `unit`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a limit of 0.
    pub fn new(limit: usize, unit: LengthUnit) -> Result<Splitter> {
        if limit == 0 {
            return Err(Error::invalid("limit", "must be at least 1"));
        }
        Ok(Splitter {
            limit,
            unit,
            markup: Markup::Markdown,
        })
    }

    const fn preset(limit: usize, unit: LengthUnit) -> Splitter {
        Splitter {
            limit,
            unit,
            markup: Markup::Markdown,
        }
    }

    /// The same splitter for text in `markup`.
    ///
    /// ```
    /// use chunked_outbox::Splitter;
    /// use chunked_outbox::split::{LengthUnit, Markup};
    ///
    /// let html = Splitter::new(25, LengthUnit::Utf16)?.with_markup(Markup::TelegramHtml);
    /// let chunks = html.split("<b>bold words that go on and on</b> plain")?;
    /// assert_eq!(chunks, ["<b>bold words that </b>", "<b>go on and on</b> plain"]);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    pub const fn with_markup(self, markup: Markup) -> Splitter {
        Splitter { markup, ..self }
    }

    /// The markup cuts respect.
    pub fn markup(&self) -> Markup {
        self.markup
    }

    /// Telegram: 4096 characters per message after entity parsing, counted in UTF-16
    /// code units like entity offsets (Bot API, `sendMessage`: "1-4096 characters").
    pub const fn telegram() -> Splitter {
        Self::preset(4096, LengthUnit::Utf16)
    }

    /// Discord: 2000 characters of message `content` (API reference, "Create
    /// Message"); counted in UTF-16 units, which is never fewer than characters.
    pub const fn discord() -> Splitter {
        Self::preset(2000, LengthUnit::Utf16)
    }

    /// Slack: `chat.postMessage` recommends at most 4000 characters of `text` (longer
    /// texts are truncated at 40,000).
    pub const fn slack() -> Splitter {
        Self::preset(4000, LengthUnit::Chars)
    }

    /// WhatsApp Business (Cloud API): text message `body` up to 4096 characters.
    pub const fn whatsapp() -> Splitter {
        Self::preset(4096, LengthUnit::Chars)
    }

    /// WeCom (WeChat Work) group robot: markdown/text `content` at most 2048 bytes of
    /// UTF-8.
    pub const fn wecom() -> Splitter {
        Self::preset(2048, LengthUnit::Bytes)
    }

    /// LINE Messaging API: text message up to 5000 characters, counted in UTF-16 code
    /// units.
    pub const fn line() -> Splitter {
        Self::preset(5000, LengthUnit::Utf16)
    }

    /// Matrix: a whole event must stay within 65,536 bytes (client-server spec, "Size
    /// limits"), including JSON, `formatted_body` and signatures; half of that for the
    /// `body` leaves room for all of them.
    pub const fn matrix() -> Splitter {
        Self::preset(32_768, LengthUnit::Bytes)
    }

    /// The limit, in [`unit`](Self::unit)s.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How length is counted.
    pub fn unit(&self) -> LengthUnit {
        self.unit
    }

    /// Splits `text` into chunks, each at most [`limit`](Self::limit) long and none
    /// empty or whitespace-only. Concatenated (less the fence lines the splitter added),
    /// the chunks give back `text`, except trailing whitespace and whitespace runs that
    /// fit in no chunk beside text (they would have to go out alone, which platforms
    /// refuse), which are dropped at the chunk boundary where they fall.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] if `text` is empty or whitespace-only, or if the limit is
    /// too small to hold one grapheme cluster (plus the fence markers a code block
    /// needs).
    pub fn split(&self, text: &str) -> Result<Vec<String>> {
        Ok(self
            .pieces(text)?
            .into_iter()
            .map(|p| format!("{}{}{}", p.prefix, &text[p.body], p.suffix))
            .collect())
    }

    /// The chunks as added prefix + a slice of the original + added suffix; the slices
    /// are in order, and what lies between and after them is whitespace only.
    pub(crate) fn pieces(&self, text: &str) -> Result<Vec<Piece>> {
        if text.trim().is_empty() {
            return Err(Error::invalid("text", "must not be empty or whitespace"));
        }
        let mut open = Open::new(self.markup);
        let mut pieces = Vec::new();
        let mut start = 0;
        while !text[start..].trim().is_empty() {
            let prefix = open.reopen();
            let rest = &text[start..];
            let used = self.unit.len(&prefix);
            // Measured only up to the room left, and markup scanned only in a rest that
            // fits, so long texts stay linear.
            let room = self.limit.saturating_sub(used);
            let whole_fits = self.unit.fits(rest, room) && {
                // A text that ends inside a code block (a truncated answer) is still one
                // chunk when the closing marker fits too.
                let close = open.after(rest).close(rest);
                self.unit
                    .fits(rest, room.saturating_sub(self.unit.len(&close)))
            };
            let end = if whole_fits {
                rest.len()
            } else {
                self.cut_with_room_to_close(rest, &open, used)?
            };
            let body = start..start + end;
            start += end;
            open.scan(&text[body.clone()]);
            let suffix = open.close(&text[body.clone()]);
            if prefix.is_empty() && suffix.is_empty() && text[body.clone()].trim().is_empty() {
                // A whitespace run longer than a chunk: nothing a platform would show.
                continue;
            }
            pieces.push(Piece {
                prefix,
                body,
                suffix,
            });
        }
        Ok(pieces)
    }

    /// A cut of `rest` that leaves room for the markup it has to close (a fence, HTML
    /// tags). The room kept starts at what closes the markup open now and grows to what
    /// the cut actually leaves open, so it is never more than needed.
    fn cut_with_room_to_close(&self, rest: &str, open: &Open, used: usize) -> Result<usize> {
        let mut reserve = self.unit.len(&open.close(""));
        loop {
            let room = self.limit.saturating_sub(used + reserve);
            let end = self.cut(rest, room)?;
            let close = self.unit.len(&open.after(&rest[..end]).close(&rest[..end]));
            if close <= reserve {
                return Ok(end);
            }
            reserve = close;
        }
    }

    /// Where to cut `rest` so the cut-off part measures at most `room`.
    fn cut(&self, rest: &str, room: usize) -> Result<usize> {
        // Grapheme boundaries that fit and where a cut may fall (in HTML, not inside a
        // tag or an entity), the last one that fits at all, and the one at half the room.
        let mut used = 0;
        let mut boundaries = Vec::new();
        let mut fit_end = None;
        let mut half_end = 0;
        let mut markup = MarkupScan::default();
        for (at, g) in rest.grapheme_indices(true) {
            used += self.unit.len(g);
            if used > room {
                break;
            }
            let end = at + g.len();
            fit_end = Some(end);
            if self.markup == Markup::TelegramHtml && !markup.step(g) {
                continue;
            }
            boundaries.push(end);
            if used <= room / 2 {
                half_end = end;
            }
        }
        let Some(fit_end) = fit_end else {
            return Err(Error::invalid(
                "limit",
                format!(
                    "{} {:?} units cannot hold the next grapheme cluster plus its markup",
                    self.limit, self.unit
                ),
            ));
        };
        let Some(&max_end) = boundaries.last() else {
            // Only in HTML: the tags to reopen, the next tag and the tags to close do
            // not fit together. Cutting the tag would make a chunk Telegram refuses.
            return Err(Error::invalid(
                "limit",
                format!(
                    "{} {:?} units cannot hold the open tags plus the next tag ({fit_end} bytes fit)",
                    self.limit, self.unit
                ),
            ));
        };
        let allowed = |cut: usize| boundaries.binary_search(&cut).is_ok();
        let cut = [paragraph_end, line_end, sentence_end, space_end]
            .iter()
            .find_map(|find| {
                // The finder's last candidate, or an earlier one if a cut may not fall there.
                let mut end = max_end;
                while let Some(cut) = find(rest, half_end..end) {
                    if allowed(cut) {
                        return Some(cut);
                    }
                    end = rest[..cut].char_indices().next_back()?.0;
                }
                None
            })
            .unwrap_or(max_end);
        Ok(match self.markup {
            Markup::Markdown => avoid_fence_line(rest, cut),
            Markup::TelegramHtml => cut,
        })
    }
}

/// Follows HTML one grapheme at a time: whether the position after it may take a cut
/// (outside every tag and character entity).
#[derive(Debug, Default)]
struct MarkupScan {
    in_tag: bool,
    in_entity: bool,
}

impl MarkupScan {
    fn step(&mut self, grapheme: &str) -> bool {
        for c in grapheme.chars() {
            match c {
                '<' => self.in_tag = true,
                '>' => self.in_tag = false,
                '&' if !self.in_tag => self.in_entity = true,
                // The `;` that ends an entity, or whatever ends a bare `&` (Telegram
                // refuses one, but it is no entity to keep whole).
                c if self.in_entity && !(c.is_ascii_alphanumeric() || c == '#') => {
                    self.in_entity = false
                }
                _ => {}
            }
        }
        !self.in_tag && !self.in_entity
    }
}

/// One chunk: markers the splitter added around a slice of the original text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub prefix: String,
    pub body: Range<usize>,
    pub suffix: String,
}

/// The last cut in `window` after a blank line.
fn paragraph_end(s: &str, window: Range<usize>) -> Option<usize> {
    s[..window.end]
        .rfind("\n\n")
        .map(|i| i + 2)
        .filter(|i| *i > window.start)
}

/// The last cut in `window` after a line break.
fn line_end(s: &str, window: Range<usize>) -> Option<usize> {
    s[..window.end]
        .rfind('\n')
        .map(|i| i + 1)
        .filter(|i| *i > window.start)
}

/// The last cut in `window` after sentence punctuation and a space.
fn sentence_end(s: &str, window: Range<usize>) -> Option<usize> {
    let head = &s[..window.end];
    head.char_indices()
        .rev()
        .take_while(|(i, _)| *i > window.start)
        .find(|(i, c)| {
            c.is_whitespace()
                && head[..*i]
                    .chars()
                    .next_back()
                    .is_some_and(|p| matches!(p, '.' | '!' | '?' | '。' | '！' | '？'))
        })
        .map(|(i, c)| i + c.len_utf8())
}

/// The last cut in `window` after whitespace.
fn space_end(s: &str, window: Range<usize>) -> Option<usize> {
    let head = &s[..window.end];
    head.char_indices()
        .rev()
        .take_while(|(i, _)| *i >= window.start)
        .find(|(_, c)| c.is_whitespace())
        .map(|(i, c)| i + c.len_utf8())
        .filter(|i| *i > window.start)
}

/// Moves a cut that would fall inside a fence line back to the start of that line, so
/// a fence marker is never torn in two (unless the line is the whole chunk).
fn avoid_fence_line(s: &str, cut: usize) -> usize {
    let line_start = s[..cut].rfind('\n').map_or(0, |i| i + 1);
    let line_end = s[cut..].find('\n').map_or(s.len(), |i| cut + i);
    if line_start > 0 && cut < line_end && fence_marker(&s[line_start..line_end]).is_some() {
        line_start
    } else {
        cut
    }
}

/// The fence marker (``` or ~~~, three or more) and info string of a fence line.
fn fence_marker(line: &str) -> Option<(&str, &str)> {
    let trimmed = line.trim_start_matches(' ');
    if line.len() - trimmed.len() > 3 {
        return None;
    }
    let ch = trimmed.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let len = trimmed.len() - trimmed.trim_start_matches(ch).len();
    (len >= 3).then(|| {
        (
            &trimmed[..len],
            trimmed[len..].trim_end_matches(['\r', ' ']),
        )
    })
}

/// The markup open at a point of the text: what a chunk ending there must close and
/// the next one reopen.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Open {
    Fence(FenceState),
    Tags(TagState),
}

impl Open {
    fn new(markup: Markup) -> Open {
        match markup {
            Markup::Markdown => Open::Fence(FenceState::default()),
            Markup::TelegramHtml => Open::Tags(TagState::default()),
        }
    }

    fn scan(&mut self, text: &str) {
        match self {
            Open::Fence(f) => f.scan(text),
            Open::Tags(t) => t.scan(text),
        }
    }

    /// The state after `text`, without changing `self`.
    fn after(&self, text: &str) -> Open {
        let mut next = self.clone();
        next.scan(text);
        next
    }

    /// What reopens the open markup at the start of the next chunk.
    fn reopen(&self) -> String {
        match self {
            Open::Fence(f) => f.reopen_line(),
            Open::Tags(t) => t.reopen(),
        }
    }

    /// What closes the open markup at the end of a chunk whose body is `body`.
    fn close(&self, body: &str) -> String {
        match self {
            Open::Fence(f) => f.close_line(body),
            Open::Tags(t) => t.close(),
        }
    }
}

/// The HTML tags open at a point of the text, outermost first: each tag's name and
/// its whole opening tag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TagState {
    open: Vec<(String, String)>,
}

impl TagState {
    /// Follows the tags of `text`. A tag cut off at the end is ignored (a cut never falls
    /// inside one, see [`MarkupScan`]).
    fn scan(&mut self, text: &str) {
        let mut rest = text;
        while let Some(lt) = rest.find('<') {
            let Some(len) = rest[lt..].find('>') else {
                return;
            };
            let tag = &rest[lt..lt + len + 1];
            rest = &rest[lt + len + 1..];
            let inner = &tag[1..tag.len() - 1];
            if let Some(name) = inner.strip_prefix('/') {
                let name = tag_name(name);
                if let Some(at) = self.open.iter().rposition(|(n, _)| *n == name) {
                    self.open.truncate(at);
                }
            } else if !inner.ends_with('/') {
                let name = tag_name(inner);
                if !name.is_empty() {
                    self.open.push((name, tag.to_owned()));
                }
            }
        }
    }

    fn reopen(&self) -> String {
        self.open.iter().map(|(_, tag)| tag.as_str()).collect()
    }

    fn close(&self) -> String {
        self.open
            .iter()
            .rev()
            .map(|(name, _)| format!("</{name}>"))
            .collect()
    }
}

/// The lower-cased name of a tag from its inside (`a href="..."` → `a`).
fn tag_name(inner: &str) -> String {
    inner
        .split(|c: char| c.is_whitespace())
        .next()
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// Whether a fenced code block is open, and the line that opened it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct FenceState {
    /// The marker and the whole opening line, while a block is open.
    open: Option<(String, String)>,
}

impl FenceState {
    #[cfg(test)]
    fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Follows the fence lines of `text`. A last line without its newline still counts:
    /// a cut never falls inside a fence line (see [`avoid_fence_line`]).
    fn scan(&mut self, text: &str) {
        for line in text.lines() {
            let Some((marker, info)) = fence_marker(line) else {
                continue;
            };
            match &self.open {
                None => self.open = Some((marker.to_owned(), line.trim_end().to_owned())),
                Some((open, _))
                    if info.is_empty()
                        && marker.starts_with(&open[..1])
                        && marker.len() >= open.len() =>
                {
                    self.open = None
                }
                Some(_) => {}
            }
        }
    }

    /// The line that reopens the block at the start of the next chunk.
    fn reopen_line(&self) -> String {
        self.open
            .as_ref()
            .map(|(_, line)| format!("{}\n", line.trim_start()))
            .unwrap_or_default()
    }

    /// The marker that closes the block at the end of a chunk whose body is `body`.
    fn close_line(&self, body: &str) -> String {
        match &self.open {
            Some((marker, _)) if body.ends_with('\n') => marker.clone(),
            Some((marker, _)) => format!("\n{marker}"),
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn fences_balanced(chunk: &str) -> bool {
        let mut state = FenceState::default();
        state.scan(chunk);
        !state.is_open()
    }

    /// Whether a chunk of Telegram HTML parses alone: tags whole and nested properly,
    /// entities whole.
    fn html_parses(chunk: &str) -> bool {
        let mut stack = Vec::new();
        let mut rest = chunk;
        while let Some(i) = rest.find(['<', '&']) {
            let tail = &rest[i..];
            if tail.starts_with('&') {
                let Some(semi) = tail.find(';') else {
                    return false;
                };
                if !matches!(&tail[..=semi], "&amp;" | "&lt;" | "&gt;" | "&quot;") {
                    return false;
                }
                rest = &tail[semi + 1..];
                continue;
            }
            let Some(gt) = tail.find('>') else {
                return false;
            };
            let inner = &tail[1..gt];
            match inner.strip_prefix('/') {
                Some(name) => {
                    if stack.pop() != Some(name.to_owned()) {
                        return false;
                    }
                }
                None => stack.push(tag_name(inner)),
            }
            rest = &tail[gt + 1..];
        }
        stack.is_empty()
    }

    fn html_strategy() -> impl Strategy<Value = String> {
        let atom = prop_oneof![
            "[a-z]{1,8}".prop_map(|w| w),
            Just(" ".to_owned()),
            Just("\n".to_owned()),
            Just("&amp;".to_owned()),
            Just("&lt;".to_owned()),
            Just("日本語 ".to_owned()),
            Just("🚀".to_owned()),
        ];
        let leaf = prop::collection::vec(atom, 1..12).prop_map(|v| v.concat());
        leaf.prop_recursive(3, 40, 6, |inner| {
            (
                prop_oneof![
                    Just(("<b>", "</b>")),
                    Just(("<i>", "</i>")),
                    Just(("<a href=\"https://example.com/a b\">", "</a>")),
                    Just(("<pre><code class=\"language-rust\">", "</code></pre>")),
                    Just(("<blockquote expandable>", "</blockquote>")),
                ],
                prop::collection::vec(inner, 1..4),
            )
                .prop_map(|((open, close), parts)| format!("{open}{}{close}", parts.concat()))
        })
    }

    #[test]
    fn html_tags_are_closed_and_reopened_and_never_cut() {
        let splitter = Splitter::new(40, LengthUnit::Utf16)
            .unwrap()
            .with_markup(Markup::TelegramHtml);
        assert_eq!(splitter.markup(), Markup::TelegramHtml);
        assert_eq!(Splitter::telegram().markup(), Markup::Markdown);
        let text = "<a href=\"https://t.me/x\">a link with &amp; several words in it</a> end";
        let chunks = splitter.split(text).unwrap();
        assert!(chunks.len() > 1, "{chunks:?}");
        for c in &chunks {
            assert!(LengthUnit::Utf16.len(c) <= 40, "{c:?}");
            assert!(html_parses(c), "{c:?}");
        }
        assert!(
            chunks[1].starts_with("<a href=\"https://t.me/x\">"),
            "{chunks:?}"
        );
        // Tags that cannot fit beside the ones to reopen are refused, not cut.
        let nested =
            "<a href=\"https://example.com/a b\"><a href=\"https://example.com/a b\">a</a></a>";
        let err = Splitter::new(60, LengthUnit::Utf16)
            .unwrap()
            .with_markup(Markup::TelegramHtml)
            .split(nested)
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput { what: "limit", .. }),
            "{err:?}"
        );
        // Markdown mode would not know the tags.
        let plain = Splitter::new(40, LengthUnit::Utf16)
            .unwrap()
            .split(text)
            .unwrap();
        assert!(!plain.iter().all(|c| html_parses(c)), "{plain:?}");
    }

    /// A cut never falls inside a character entity, and a bare `&` is no entity: text
    /// after it can still be cut.
    #[test]
    fn html_entities_are_never_cut_and_a_bare_ampersand_is_text() {
        let html = |limit| {
            Splitter::new(limit, LengthUnit::Chars)
                .unwrap()
                .with_markup(Markup::TelegramHtml)
        };
        let entities = "&amp;".repeat(50);
        let chunks = html(23).split(&entities).unwrap();
        assert!(chunks.len() > 1);
        for c in &chunks {
            assert!(c.len() <= 23 && c.len() % 5 == 0 && html_parses(c), "{c:?}");
        }
        let bare = "fish & chips ".repeat(10);
        let chunks = html(30).split(&bare).unwrap();
        assert!(chunks.iter().all(|c| c.chars().count() <= 30), "{chunks:?}");
        assert_eq!(chunks.concat().trim_end(), bare.trim_end());
        // Inside a tag an `&` starts nothing, even in an unquoted attribute.
        let unquoted = format!("<a href=t.me/x&y>{}</a>", "abcdefghij".repeat(4));
        let chunks = html(40).split(&unquoted).unwrap();
        assert!(chunks.iter().all(|c| c.chars().count() <= 40), "{chunks:?}");
        let link = "<a href=\"https://x.org/?a=1&b=2\">a long enough link text</a>";
        for c in html(60).split(link).unwrap() {
            assert!(html_parses(&c.replace("&b", "&amp;b")), "{c:?}");
        }
    }

    #[test]
    fn open_tags_are_followed_through_nesting_and_closing() {
        let mut tags = TagState::default();
        tags.scan("<b>bold <i>both</i></b><a href=\"u\">link <code>x");
        assert_eq!(tags.reopen(), "<a href=\"u\"><code>");
        assert_eq!(tags.close(), "</code></a>");
        tags.scan("</code> end</a><br/>");
        assert_eq!(
            (tags.reopen(), tags.close()),
            (String::new(), String::new())
        );
    }

    /// Breaks are looked for in the second half of the room only: a paragraph break
    /// near the start does not make a tiny chunk.
    #[test]
    fn an_early_break_does_not_make_a_tiny_chunk() {
        let s = Splitter::new(30, LengthUnit::Chars).unwrap();
        let chunks = s
            .split("Hi.\n\nThis sentence runs on and on and on for a while")
            .unwrap();
        assert!(chunks[0].len() > 15, "{chunks:?}");
    }

    #[test]
    fn short_text_is_one_chunk() {
        let s = Splitter::telegram();
        assert_eq!(s.split("hello").unwrap(), ["hello"]);
    }

    #[test]
    fn prefers_paragraph_then_line_then_sentence_then_word() {
        let s = Splitter::new(30, LengthUnit::Chars).unwrap();
        assert_eq!(
            s.split("Para one is here.\n\nPara two follows on.")
                .unwrap(),
            ["Para one is here.\n\n", "Para two follows on."]
        );
        assert_eq!(
            s.split("Line one is here.\nLine two follows on.").unwrap(),
            ["Line one is here.\n", "Line two follows on."]
        );
        assert_eq!(
            s.split("Sentence one here. Sentence two follows.").unwrap(),
            ["Sentence one here. ", "Sentence two follows."]
        );
        assert_eq!(
            s.split("words words words words words words").unwrap(),
            ["words words words words words ", "words"]
        );
    }

    #[test]
    fn never_splits_a_grapheme_cluster() {
        // A family emoji is 7 chars, 11 UTF-16 units and 25 bytes, but one grapheme.
        let family = "👩‍👩‍👧‍👦";
        let text = family.repeat(5);
        for (limit, unit) in [
            (25, LengthUnit::Bytes),
            (11, LengthUnit::Utf16),
            (7, LengthUnit::Chars),
        ] {
            let chunks = Splitter::new(limit, unit).unwrap().split(&text).unwrap();
            assert_eq!(chunks.len(), 5, "{unit:?}");
            assert!(chunks.iter().all(|c| c == family));
        }
        let err = Splitter::new(24, LengthUnit::Bytes)
            .unwrap()
            .split(&text)
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidInput { what: "limit", .. }),
            "{err:?}"
        );
    }

    #[test]
    fn reopens_code_fences_with_their_language() {
        let text = "Intro\n\n```rust\nfn a() {}\nfn b() {}\nfn c() {}\n```\nOutro";
        let chunks = Splitter::new(30, LengthUnit::Chars)
            .unwrap()
            .split(text)
            .unwrap();
        for c in &chunks {
            assert!(c.chars().count() <= 30, "{c:?}");
            assert!(fences_balanced(c), "unbalanced: {c:?}");
        }
        assert!(
            chunks.iter().skip(1).any(|c| c.starts_with("```rust\n")),
            "{chunks:?}"
        );
    }

    /// A language model's answer cut off inside a code block: it fits one Telegram
    /// message, so it is one, with the block closed so it renders (and parses).
    #[test]
    fn a_truncated_answer_inside_a_code_block_is_one_chunk_when_it_fits() {
        let mut text = String::from("Here is the fix:\n\n```python\n");
        while LengthUnit::Utf16.len(&text) < 3_020 {
            text.push_str("print('hello')\n");
        }
        text.push_str("print('hel");
        assert!((3_000..3_100).contains(&LengthUnit::Utf16.len(&text)));
        let chunks = Splitter::telegram().split(&text).unwrap();
        assert_eq!(
            chunks.len(),
            1,
            "{:?}",
            chunks.iter().map(|c| c.len()).collect::<Vec<_>>()
        );
        assert_eq!(chunks[0], format!("{text}\n```"));
        assert!(fences_balanced(&chunks[0]));

        // Without room for the closing marker it is cut, each part balanced.
        let tight = Splitter::new(LengthUnit::Utf16.len(&text) + 1, LengthUnit::Utf16).unwrap();
        let chunks = tight.split(&text).unwrap();
        assert_eq!(chunks.len(), 2);
        assert!(chunks.iter().all(|c| fences_balanced(c)), "{chunks:?}");
    }

    #[test]
    fn empty_text_and_zero_limit_are_refused() {
        assert!(Splitter::new(0, LengthUnit::Bytes).is_err());
        assert!(Splitter::telegram().split(" \n ").is_err());
    }

    #[test]
    fn long_whitespace_runs_never_make_a_whitespace_chunk() {
        let text = format!("a{}b{}", " ".repeat(50), "\n".repeat(50));
        let chunks = Splitter::new(8, LengthUnit::Bytes)
            .unwrap()
            .split(&text)
            .unwrap();
        assert!(chunks.iter().all(|c| !c.trim().is_empty()), "{chunks:?}");
        let squeeze = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(squeeze(&chunks.concat()), squeeze(&text));
    }

    #[test]
    fn presets_have_their_documented_limits() {
        let presets = [
            (Splitter::telegram(), 4096, LengthUnit::Utf16),
            (Splitter::discord(), 2000, LengthUnit::Utf16),
            (Splitter::slack(), 4000, LengthUnit::Chars),
            (Splitter::whatsapp(), 4096, LengthUnit::Chars),
            (Splitter::wecom(), 2048, LengthUnit::Bytes),
            (Splitter::line(), 5000, LengthUnit::Utf16),
            (Splitter::matrix(), 32_768, LengthUnit::Bytes),
        ];
        for (s, limit, unit) in presets {
            assert_eq!((s.limit(), s.unit()), (limit, unit));
        }
    }

    fn text_strategy() -> impl Strategy<Value = String> {
        let token = prop_oneof![
            4 => "[a-z]{1,8}",
            2 => Just(" ".to_owned()),
            1 => Just("\n".to_owned()),
            1 => Just("\n\n".to_owned()),
            1 => Just(". ".to_owned()),
            1 => Just("é".to_owned()),
            1 => Just("e\u{301}".to_owned()), // e + combining acute
            1 => Just("👍🏽".to_owned()),
            1 => Just("👩‍👩‍👧".to_owned()),
            1 => Just("漢字".to_owned()),
            1 => ("[a-z]{0,6}", "[a-z ]{0,40}").prop_map(|(lang, code)| format!("\n```{lang}\n{code}\n{code}\n```\n")),
        ];
        proptest::collection::vec(token, 1..120).prop_map(|t| t.concat())
    }

    fn unit_strategy() -> impl Strategy<Value = LengthUnit> {
        prop_oneof![
            Just(LengthUnit::Bytes),
            Just(LengthUnit::Chars),
            Just(LengthUnit::Utf16)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn chunks_fit_rejoin_and_keep_graphemes_and_fences(
            text in text_strategy(),
            limit in 24_usize..300,
            unit in unit_strategy(),
        ) {
            prop_assume!(!text.trim().is_empty());
            let splitter = Splitter::new(limit, unit).unwrap();
            let pieces = splitter.pieces(&text).unwrap();
            // The text as the pieces cover it: each piece's slice, and before it the
            // whitespace (if any) that was skipped because it could only go out alone.
            let mut segments = Vec::new();
            let mut at = 0;
            for p in &pieces {
                prop_assert!(p.body.start >= at);
                prop_assert!(text[at..p.body.start].trim().is_empty(), "text dropped before {:?}", p.body);
                segments.push(at..p.body.start);
                segments.push(p.body.clone());
                at = p.body.end;
                let chunk = format!("{}{}{}", p.prefix, &text[p.body.clone()], p.suffix);
                prop_assert!(unit.len(&chunk) <= limit, "chunk over limit: {chunk:?}");
                prop_assert!(!chunk.trim().is_empty(), "empty chunk");
                prop_assert!(fences_balanced(&chunk), "unbalanced fences: {chunk:?}");
                // Cuts fall on grapheme boundaries of the original text.
                prop_assert!(
                    p.body.end == text.len() || text.grapheme_indices(true).any(|(i, _)| i == p.body.end),
                    "cut inside a grapheme cluster at {}", p.body.end
                );
                prop_assert!(p.prefix.is_empty() || fence_marker(p.prefix.trim_end()).is_some());
                prop_assert!(p.suffix.is_empty() || fence_marker(p.suffix.trim_start()).is_some());
            }
            prop_assert!(text[at..].trim().is_empty(), "text dropped at the end");
            // Segment by segment, the graphemes are the text's: no cluster was cut.
            let graphemes: Vec<&str> = text[..at].graphemes(true).collect();
            let covered: Vec<&str> = segments
                .iter()
                .flat_map(|r| text[r.clone()].graphemes(true))
                .collect();
            prop_assert_eq!(covered, graphemes);
        }

        /// Telegram HTML: every chunk fits, parses on its own (no tag or entity cut in
        /// half, every tag it opens closed, none closed that it did not open), and the
        /// bodies are the original text in order.
        #[test]
        fn html_chunks_fit_and_parse_on_their_own(
            text in html_strategy(),
            // Room for the deepest reopened tags, a tag and their closing tags.
            limit in 200_usize..400,
        ) {
            prop_assume!(!text.trim().is_empty());
            let splitter = Splitter::new(limit, LengthUnit::Utf16)
                .unwrap()
                .with_markup(Markup::TelegramHtml);
            let pieces = splitter.pieces(&text).unwrap();
            let mut at = 0;
            for p in &pieces {
                prop_assert!(text[at..p.body.start].trim().is_empty());
                at = p.body.end;
                let chunk = format!("{}{}{}", p.prefix, &text[p.body.clone()], p.suffix);
                prop_assert!(LengthUnit::Utf16.len(&chunk) <= limit, "over limit: {chunk:?}");
                prop_assert!(html_parses(&chunk), "does not parse alone: {chunk:?}");
            }
            prop_assert!(text[at..].trim().is_empty(), "text dropped at the end");
        }

        #[test]
        fn tiny_limits_error_instead_of_hanging(text in text_strategy(), limit in 1_usize..24) {
            prop_assume!(!text.trim().is_empty());
            if let Ok(chunks) = Splitter::new(limit, LengthUnit::Bytes).unwrap().split(&text) {
                prop_assert!(chunks.iter().all(|c| c.len() <= limit && !c.trim().is_empty()));
            }
        }
    }
}
