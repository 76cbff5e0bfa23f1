//! `doctor`'s SQL literal masker (a query text from `pg_stat_activity`): never panics on
//! any text, and on a query made of PostgreSQL tokens its output holds nothing of any
//! string constant (`'...'`, `E'...'`, `$tag$...$tag$`), numeric constant or comment.
//! Literal bodies are the only place characters of the Private Use Area and digits
//! (outside `$n` parameters) appear, so finding one in the output is a leak.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::fuzzing::mask_literals;

#[derive(Debug, Arbitrary)]
enum Token {
    Keyword(u8),
    Identifier(String),
    QuotedIdentifier(String),
    Param(u8),
    Punct(u8),
    String(String),
    Escaped(String),
    Dollar(String, String),
    Number(String),
    LineComment(String),
    BlockComment(String),
}

#[derive(Debug, Arbitrary)]
struct Input {
    tokens: Vec<Token>,
    /// What separates tokens: 0 a space, 1 a newline, 2 nothing where PostgreSQL needs none.
    glue: Vec<u8>,
    max: u16,
    raw: String,
}

const KEYWORDS: [&str; 8] = [
    "SELECT", "FROM", "WHERE", "INSERT", "INTO", "VALUES", "AND", "e",
];
const PUNCT: [&str; 10] = [",", "(", ")", "=", ";", ".", "+", "-", "*", "::"];
const MARK: char = '\u{E000}';

fn private(c: char) -> bool {
    ('\u{E000}'..='\u{F8FF}').contains(&c)
}

/// A literal's body: the fuzzer's text, and marks at both ends so that any part of it
/// that leaks carries one.
fn body(text: &str) -> String {
    format!("{MARK}{text}{MARK}")
}

/// Text outside literals: no marks, no digits.
fn plain(text: &str) -> String {
    text.chars()
        .filter(|c| !private(*c) && !c.is_ascii_digit())
        .collect()
}

fn word(text: &str) -> String {
    let w: String = plain(text)
        .chars()
        .filter(|c| c.is_ascii_alphabetic() || *c == '_')
        .collect();
    if w.is_empty() { "x".to_owned() } else { w }
}

fn render(token: &Token) -> (String, bool) {
    // (text, whether it needs a space before it to stay one token)
    match token {
        Token::Keyword(i) => (KEYWORDS[usize::from(*i) % KEYWORDS.len()].to_owned(), true),
        Token::Identifier(t) => (word(t), true),
        Token::QuotedIdentifier(t) => (format!("\"{}\"", plain(t).replace('"', "\"\"")), false),
        Token::Param(n) => (format!("${}", n % 9 + 1), true),
        Token::Punct(i) => (PUNCT[usize::from(*i) % PUNCT.len()].to_owned(), false),
        Token::String(t) => (format!("'{}'", body(t).replace('\'', "''")), false),
        Token::Escaped(t) => (
            format!("E'{}'", body(t).replace('\\', "\\\\").replace('\'', "\\'")),
            true,
        ),
        Token::Dollar(tag, t) => {
            let tag = if tag.is_empty() {
                String::new()
            } else {
                word(tag)
            };
            let close = format!("${tag}$");
            let mut text = body(t);
            while text.contains(&close) {
                text = text.replace(&close, "");
            }
            // A body ending in `$tag` would close early once the `$` is added.
            (format!("{close}{text}{close}"), true)
        }
        Token::Number(t) => {
            let digits: String = t.chars().filter(char::is_ascii_digit).collect();
            (
                if digits.is_empty() {
                    "7".to_owned()
                } else {
                    digits
                },
                true,
            )
        }
        Token::LineComment(t) => (format!("--{}\n", body(t).replace(['\n', '\r'], "")), false),
        Token::BlockComment(t) => {
            let mut text = body(t);
            while text.contains("*/") || text.contains("/*") {
                text = text.replace("*/", "").replace("/*", "");
            }
            (format!("/*{text}*/"), false)
        }
    }
}

fuzz_target!(|input: Input| {
    let max = usize::from(input.max);
    let _ = mask_literals(&input.raw, max);

    let mut query = String::new();
    for (i, token) in input.tokens.iter().enumerate() {
        let (text, needs_space) = render(token);
        let glue = input.glue.get(i).copied().unwrap_or(0) % 3;
        if !query.is_empty() {
            if glue == 1 {
                query.push('\n');
            } else if glue == 0
                || needs_space
                || query
                    .ends_with(|c: char| c.is_alphanumeric() || matches!(c, '_' | '$' | '-' | '/'))
            {
                query.push(' ');
            }
        }
        query.push_str(&text);
    }
    let masked = mask_literals(&query, max.max(1));
    let mut previous = ' ';
    for c in masked.chars() {
        assert!(!private(c), "a literal leaked: {query:?} -> {masked:?}");
        // Digits stay only in parameters (`$1`).
        assert!(
            !c.is_ascii_digit() || previous == '$',
            "a number leaked: {query:?} -> {masked:?}"
        );
        previous = c;
    }
});
