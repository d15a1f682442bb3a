//! Chat templates rendered with minijinja the way transformers' `apply_chat_template(messages,
//! add_generation_prompt=True, tokenize=False)` renders them with jinja2: trim_blocks and
//! lstrip_blocks, the globals `raise_exception` / `strftime_now`, transformers' `tojson`,
//! Python string / dict / list methods (minijinja-contrib pycompat), the named special tokens
//! (`bos_token`, `eos_token`, ...) and `tools` / `documents` as None.

use std::fmt;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

use super::pyfmt::{dumps, strftime_now, DumpOptions};
use super::tokenizer::Tokenizer;
use super::TextError;

const TEMPLATE_NAME: &str = "chat";
const NO_TEMPLATE: &str = "Cannot use chat template functions because tokenizer.chat_template is \
                           not set and no template argument was passed!";
/// Names a message's reasoning is passed under (transformers `_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A JSON object as the template sees it: a dict that keeps its keys in insertion order, as
/// Python dicts do (`message.items()`, `tojson`).
#[derive(Debug, Default)]
struct OrderedMap(Vec<(Arc<str>, Value)>);

impl OrderedMap {
    fn insert(&mut self, key: &str, value: Value) {
        match self.0.iter_mut().find(|(k, _)| &**k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((Arc::from(key), value)),
        }
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| &**k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let keys: Vec<Value> = self.0.iter().map(|(k, _)| Value::from(k.clone())).collect();
        Enumerator::Iter(Box::new(keys.into_iter()))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// A JSON value as a template value (objects keep their key order).
pub fn json_to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(xs) => Value::from(xs.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(m) => {
            let mut out = OrderedMap::default();
            for (k, x) in m {
                out.insert(k, json_to_value(x));
            }
            Value::from_object(out)
        }
    }
}

/// The error `raise_exception(message)` raises: its message is the whole error text.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "indent must be an int or a string",
                    )
                })?;
                " ".repeat(usize::try_from(n).unwrap_or(0))
            }
        }),
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => match (a.as_str(), b.as_str()) {
                    (Some(a), Some(b)) => Some((a.to_owned(), b.to_owned())),
                    _ => None,
                },
                _ => None,
            }
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "separators must be two strings",
                )
            })
            .map(Some)?
        }
        _ => None,
    };
    let opts = DumpOptions {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(Value::from(dumps(value, &opts)?))
}

/// transformers' `{% generation %}` blocks render their body unchanged unless an assistant
/// mask is asked for: they become `{% if true %}` blocks with the same whitespace control.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = split_ws_marker_front(inner);
        let (body, trail) = split_ws_marker_back(body);
        match body.trim() {
            "generation" => {
                out.push_str(&format!("{{%{lead} if true {trail}%}}"));
            }
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_marker_front(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some('-' | '+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_ws_marker_back(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some('-' | '+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

/// The default chat template of a model folder, as transformers picks it: the
/// `chat_template.jinja` / `additional_chat_templates/*.jinja` files win over
/// tokenizer_config.json's `chat_template` (a string, or a list of `{name, template}`); of
/// several named templates, "default" is used.
pub fn find_template(dir: &Path, config: &serde_json::Map<String, Json>) -> Result<String, String> {
    let mut named: Vec<(String, String)> = Vec::new();
    let read =
        |p: &Path| fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let main = dir.join("chat_template.jinja");
    if main.is_file() {
        named.push(("default".to_owned(), read(&main)?));
    }
    if let Ok(entries) = fs::read_dir(dir.join("additional_chat_templates")) {
        let mut files: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
        files.sort();
        for p in files {
            if p.extension().and_then(|e| e.to_str()) == Some("jinja") {
                if let Some(stem) = p.file_stem().and_then(|s| s.to_str()) {
                    named.push((stem.to_owned(), read(&p)?));
                }
            }
        }
    }
    if named.is_empty() {
        match config.get("chat_template") {
            None | Some(Json::Null) => return Err(NO_TEMPLATE.to_owned()),
            Some(Json::String(s)) => return Ok(s.clone()),
            Some(Json::Array(xs)) => {
                for x in xs {
                    let name = x.get("name").and_then(Json::as_str);
                    let tpl = x.get("template").and_then(Json::as_str);
                    match (name, tpl) {
                        (Some(n), Some(t)) => named.push((n.to_owned(), t.to_owned())),
                        _ => {
                            return Err("tokenizer_config.json: a chat_template entry lacks a \
                                         name or template"
                                .to_owned())
                        }
                    }
                }
            }
            Some(_) => {
                return Err(
                    "tokenizer_config.json: chat_template must be a string or a \
                                   list of named templates"
                        .to_owned(),
                )
            }
        }
    }
    if named.len() == 1 && named[0].0 == "default" {
        return Ok(named.swap_remove(0).1);
    }
    if let Some(i) = named.iter().position(|(n, _)| n == "default") {
        return Ok(named.swap_remove(i).1);
    }
    let mut names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    Err(format!(
        "This model has multiple chat templates with no default specified! Please either pass a \
         chat template or the name of the template you wish to use to the `chat_template` \
         argument. Available template names are {names:?}."
    ))
}

/// A compiled chat template plus the special-token variables it is rendered with. A model
/// without a usable template still loads: rendering then fails with the reason.
pub struct ChatTemplate {
    env: Result<Environment<'static>, String>,
    special_tokens: Vec<(&'static str, String)>,
}

fn environment(source: &str) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| format!("chat template syntax: {e}"))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source))
        .map_err(|e| format!("invalid chat template: {}", error_text(&e)))?;
    Ok(env)
}

/// An error as the user sees it: `raise_exception`'s message alone, else minijinja's text.
fn error_text(e: &Error) -> String {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return r.0.clone();
        }
        src = s.source();
    }
    e.to_string()
}

/// The messages as transformers hands them to the template, after checking their shape: a
/// non-empty list of objects with a string `role` and a string (or absent / null) `content`.
/// Keys whose value is null are dropped and the reasoning fields aliased, as transformers does.
fn template_messages(messages: &Json) -> Result<Value, TextError> {
    let Json::Array(list) = messages else {
        return Err(TextError::new("messages must be a list of objects"));
    };
    if list.is_empty() {
        return Err(TextError::new(
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Json::Object(m) = m else {
            return Err(TextError::new(format!("messages[{i}] must be an object")));
        };
        if !matches!(m.get("role"), Some(Json::String(_))) {
            return Err(TextError::new(format!(
                "messages[{i}].role must be a string"
            )));
        }
        if !matches!(m.get("content"), None | Some(Json::Null | Json::String(_))) {
            return Err(TextError::new(format!(
                "messages[{i}].content must be a string"
            )));
        }
        let mut map = OrderedMap::default();
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|f| m.get(*f).filter(|v| !v.is_null()));
        if let Some(r) = reasoning {
            map.insert("thinking", json_to_value(r));
        }
        for (k, v) in m.iter().filter(|(_, v)| !v.is_null()) {
            map.insert(k, json_to_value(v));
        }
        if let Some(r) = reasoning {
            map.insert("reasoning_content", json_to_value(r));
        }
        out.push(Value::from_object(map));
    }
    Ok(Value::from(out))
}

impl ChatTemplate {
    /// The model folder's default chat template, with the tokenizer's special tokens.
    pub fn for_tokenizer(tok: &Tokenizer) -> Self {
        let env = find_template(tok.dir(), tok.config()).and_then(|src| environment(&src));
        Self {
            env,
            special_tokens: tok.special_tokens_map().to_vec(),
        }
    }

    /// A template from its source (special tokens as `(name, value)`, e.g. `("bos_token", ..)`).
    pub fn from_source(source: &str, special_tokens: Vec<(&'static str, String)>) -> Self {
        Self {
            env: environment(source),
            special_tokens,
        }
    }

    /// Why the template cannot be used, if it cannot.
    pub fn load_error(&self) -> Option<&str> {
        self.env.as_ref().err().map(String::as_str)
    }

    /// `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`.
    pub fn render(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let env = self.env.as_ref().map_err(|e| TextError::new(e.clone()))?;
        let messages = template_messages(messages)?;
        let tmpl = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::new(error_text(&e)))?;
        let mut ctx = OrderedMap::default();
        for (k, v) in &self.special_tokens {
            ctx.insert(k, Value::from(v.as_str()));
        }
        ctx.insert("messages", messages);
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        let ctx = Value::from_object(ctx);
        tmpl.render(ctx).map_err(|e| TextError::new(error_text(&e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\
                          <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>\
                          assistant\n{% endif %}";

    fn specials() -> Vec<(&'static str, String)> {
        vec![("bos_token", "<s>".into()), ("eos_token", "</s>".into())]
    }

    #[test]
    fn chatml_renders_like_transformers() {
        let t = ChatTemplate::from_source(CHATML, specials());
        let msgs = json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]);
        assert_eq!(
            t.render(&msgs, true).expect("render"),
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_are_on() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::from_source(src, specials());
        let msgs = json!([{"role": "user", "content": "a"}, {"role": "x", "content": "b"}]);
        assert_eq!(t.render(&msgs, false).expect("render"), "[a]\n");
    }

    #[test]
    fn globals_filters_and_pycompat_methods() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}|\
                   {{ m | tojson }}|{{ m.items() | list | length }}{% endfor %}\
                   {{ tools is none }}{{ eos_token }}{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::from_source(src, specials());
        let msgs = json!([{"role": "user", "content": " héllo ", "name": null}]);
        assert_eq!(
            t.render(&msgs, true).expect("render"),
            "<s>HÉLLO|{\"role\": \"user\", \"content\": \" héllo \"}|2True</s>4"
        );
    }

    #[test]
    fn raise_exception_message_is_the_error() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::from_source(src, specials());
        let err = t
            .render(&json!([{"role": "system", "content": "x"}]), true)
            .expect_err("must fail");
        assert_eq!(err.to_string(), "first must be user");
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), true)
                .expect("render"),
            "ok"
        );
    }

    #[test]
    fn bad_messages_are_rejected_with_a_reason() {
        let t = ChatTemplate::from_source(CHATML, specials());
        for (msgs, want) in [
            (json!([]), "empty conversation"),
            (json!("hi"), "must be a list"),
            (json!([1]), "messages[0] must be an object"),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "user", "content": [1]}]),
                "messages[0].content",
            ),
        ] {
            let err = t.render(&msgs, true).expect_err("must fail").to_string();
            assert!(err.contains(want), "{err} lacks {want}");
        }
    }

    #[test]
    fn broken_templates_fail_to_render_not_panic() {
        let t = ChatTemplate::from_source("{% for %}", specials());
        assert!(t.load_error().is_some());
        assert!(t
            .render(&json!([{"role": "user", "content": "x"}]), true)
            .is_err());
        let t = ChatTemplate::from_source("{{ messages[5].content.foo() }}", specials());
        assert!(t
            .render(&json!([{"role": "user", "content": "x"}]), true)
            .is_err());
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let src = "{% for m in messages %}{%- generation -%} {{ m.content }} {%- endgeneration %}{% endfor %}";
        let t = ChatTemplate::from_source(src, specials());
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), true)
                .expect("render"),
            "x"
        );
    }

    #[test]
    fn reasoning_fields_are_aliased() {
        let src = "{{ messages[0].thinking }}/{{ messages[0].reasoning_content }}";
        let t = ChatTemplate::from_source(src, specials());
        let msgs = json!([{"role": "assistant", "content": "a", "reasoning": "r"}]);
        assert_eq!(t.render(&msgs, false).expect("render"), "r/r");
    }
}
