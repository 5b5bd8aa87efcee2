//! A JSON object read member by member, each value kept as its raw text.
//!
//! Request bodies and events are rewritten through it: the members the
//! rewrite does not touch (a long `messages` list, a number beyond `f64`)
//! are written back byte for byte, in their order, without being parsed
//! into values.

use std::fmt;

use serde::de::{DeserializeOwned, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// See the module docs. A key given twice keeps both members; reading it
/// sees the last one, as the engines' JSON parsers do, and setting it
/// leaves one.
#[derive(Debug, Clone, Default)]
pub(super) struct RawObject {
    members: Vec<(String, Box<RawValue>)>,
}

impl RawObject {
    /// `bytes` as an object; `None` when they are not one JSON object.
    pub(super) fn parse(bytes: &[u8]) -> Option<RawObject> {
        serde_json::from_slice(bytes).ok()
    }

    /// A raw value as an object; `None` when it is not one.
    pub(super) fn parse_raw(raw: &RawValue) -> Option<RawObject> {
        serde_json::from_str(raw.get()).ok()
    }

    /// The raw value of `key`, `null` included.
    pub(super) fn get(&self, key: &str) -> Option<&RawValue> {
        self.members
            .iter()
            .rev()
            .find(|(name, _)| name == key)
            .map(|(_, value)| &**value)
    }

    /// The raw value of `key`, unless it is absent or `null`.
    pub(super) fn get_set(&self, key: &str) -> Option<&RawValue> {
        self.get(key).filter(|raw| !is_null(raw))
    }

    /// The value of `key` as a `T`; `None` when absent or not a `T`.
    pub(super) fn value<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        serde_json::from_str(self.get(key)?.get()).ok()
    }

    /// Sets `key` to `value`: in place of its first member, if any (later
    /// duplicates go), else at the end.
    pub(super) fn set_raw(&mut self, key: &str, value: Box<RawValue>) {
        let mut value = Some(value);
        self.members.retain_mut(|(name, slot)| {
            if name != key {
                return true;
            }
            match value.take() {
                Some(new) => {
                    *slot = new;
                    true
                }
                None => false,
            }
        });
        if let Some(value) = value {
            self.members.push((key.to_owned(), value));
        }
    }

    /// Sets `key` to `value` serialized; `None` if it does not serialize.
    pub(super) fn set<T: Serialize + ?Sized>(&mut self, key: &str, value: &T) -> Option<()> {
        let raw = serde_json::value::to_raw_value(value).ok()?;
        self.set_raw(key, raw);
        Some(())
    }

    /// The object as compact JSON (the raw values as they were).
    pub(super) fn to_json(&self) -> String {
        let size = self
            .members
            .iter()
            .map(|(name, value)| name.len() + value.get().len() + 4)
            .sum::<usize>();
        let mut out = String::with_capacity(size + 2);
        out.push('{');
        for (at, (name, value)) in self.members.iter().enumerate() {
            if at > 0 {
                out.push(',');
            }
            push_json_string(&mut out, name);
            out.push(':');
            out.push_str(value.get());
        }
        out.push('}');
        out
    }

    /// The object as a raw value.
    pub(super) fn to_raw(&self) -> Option<Box<RawValue>> {
        RawValue::from_string(self.to_json()).ok()
    }
}

/// Whether a raw value is `null`.
pub(super) fn is_null(raw: &RawValue) -> bool {
    raw.get() == "null"
}

/// `text` as a JSON string, quoted and escaped.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for character in text.chars() {
        match character {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            control if u32::from(control) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", u32::from(control)));
            }
            other => out.push(other),
        }
    }
    out.push('"');
}

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<RawObject, D::Error> {
        deserializer.deserialize_map(MembersVisitor)
    }
}

struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = RawObject;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawObject, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some(name) = map.next_key::<String>()? {
            let value: Box<RawValue> = map.next_value()?;
            members.push((name, value));
        }
        Ok(RawObject { members })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn untouched_members_are_written_back_as_they_were() {
        let body = br#"{ "b": 1.50, "a" : [1, 2,3], "big": 123456789012345678901234567890 }"#;
        let mut object = RawObject::parse(body).unwrap();
        object.set("a", &json!([4])).unwrap();
        assert_eq!(
            object.to_json(),
            r#"{"b":1.50,"a":[4],"big":123456789012345678901234567890}"#
        );
    }

    #[test]
    fn duplicates_read_last_and_set_leaves_one() {
        let mut object = RawObject::parse(br#"{"n":1,"x":0,"n":2}"#).unwrap();
        assert_eq!(object.value::<u64>("n"), Some(2));
        object.set("n", &3).unwrap();
        assert_eq!(object.to_json(), r#"{"n":3,"x":0}"#);
        object.set("y", "z").unwrap();
        assert_eq!(object.to_json(), r#"{"n":3,"x":0,"y":"z"}"#);
    }

    #[test]
    fn keys_are_escaped_back() {
        let object = RawObject::parse(b"{\"a\\\"b\\u0001\\n\xc3\xa9\":null}").unwrap();
        let parsed: Value = serde_json::from_str(&object.to_json()).unwrap();
        assert_eq!(parsed, json!({"a\"b\u{1}\n\u{e9}": null}));
        assert!(object.get("a\"b\u{1}\n\u{e9}").is_some());
        assert!(object.get_set("a\"b\u{1}\n\u{e9}").is_none());
    }

    #[test]
    fn anything_but_one_object_is_refused() {
        for bytes in [
            &b"[1]"[..],
            b"1",
            b"\"x\"",
            b"{",
            b"{}x",
            b"{\"a\":\xff}",
            b"{\"a\":\"\xff\"}",
            b"",
        ] {
            assert!(RawObject::parse(bytes).is_none(), "{bytes:?}");
        }
        assert!(RawObject::parse(b" {} ").is_some());
        // Out of f64's range, but JSON: kept raw, refused only as a number.
        let object = RawObject::parse(b"{\"a\":1e400}").unwrap();
        assert_eq!(object.value::<f64>("a"), None);
        assert_eq!(object.to_json(), "{\"a\":1e400}");
    }
}
