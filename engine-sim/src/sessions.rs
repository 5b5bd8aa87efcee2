//! Multi-turn chat sessions for `engine-sim drive --traffic multi-turn`.
//!
//! A few apps each have one long system prompt. A session belongs to one app:
//! it opens with that system prompt and a user message, and every next turn
//! resends the whole history (system prompt, the earlier user messages, the
//! earlier answers) plus one new user message, as a chat client does. Texts
//! are ASCII at four characters a token (the engines' and the router's
//! estimate), drawn from a seed: one seed replays the same sessions, and two
//! sessions share nothing but their app's system prompt (every user message
//! opens with its session's number).

use policy_core::splitmix::mix_at;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Characters per token of every generated text.
pub const CHARS_PER_TOKEN: usize = 4;

/// Session parameters out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionConfigError {
    #[error("--apps must be at least 1")]
    NoApps,
    #[error("--mean-turns must be finite and at least 1, got {mean_turns}")]
    MeanTurns { mean_turns: f64 },
    #[error("--max-turns must be at least 1")]
    NoTurns,
    #[error("--user-message-tokens must be at least 1")]
    EmptyUserMessage,
}

/// What the sessions look like.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    /// Apps, each with its own system prompt.
    pub apps: u32,
    pub system_prompt_tokens: u32,
    /// Mean user-message length; each is drawn from half to one and a half
    /// times this.
    pub user_message_tokens: u32,
    /// Mean turns per session (geometric: after each turn the session goes
    /// on with probability `1 - 1 / mean_turns`).
    pub mean_turns: f64,
    /// No session runs longer than this.
    pub max_turns: u32,
    pub seed: u64,
}

impl SessionConfig {
    pub fn validate(&self) -> Result<(), SessionConfigError> {
        if self.apps == 0 {
            return Err(SessionConfigError::NoApps);
        }
        if !(self.mean_turns.is_finite() && self.mean_turns >= 1.0) {
            return Err(SessionConfigError::MeanTurns {
                mean_turns: self.mean_turns,
            });
        }
        if self.max_turns == 0 {
            return Err(SessionConfigError::NoTurns);
        }
        if self.user_message_tokens == 0 {
            return Err(SessionConfigError::EmptyUserMessage);
        }
        Ok(())
    }

    /// App `app`'s system prompt: `system_prompt_tokens` tokens of text,
    /// the same for every session of the app.
    pub fn system_prompt(&self, app: u32) -> String {
        let mut rng = SmallRng::seed_from_u64(mix_at(self.seed ^ SYSTEM_SALT, u64::from(app)));
        let head = format!("You are the assistant of app {app}. Follow these rules.");
        filler(&mut rng, &head, tokens_to_chars(self.system_prompt_tokens))
    }

    /// Session `id` (any number; ids name distinct sessions), ready for its
    /// first turn.
    pub fn session(&self, id: u64) -> ChatSession {
        let mut rng = SmallRng::seed_from_u64(mix_at(self.seed, id));
        let app = rng.random_range(0..self.apps);
        let go_on = 1.0 - 1.0 / self.mean_turns;
        let mut turns = 1;
        while turns < self.max_turns && rng.random_bool(go_on) {
            turns += 1;
        }
        let mut session = ChatSession {
            id,
            app,
            turns,
            turn: 1,
            user_message_tokens: self.user_message_tokens,
            messages: vec![Message {
                role: Role::System,
                content: self.system_prompt(app),
            }],
            rng,
        };
        session.push_user_message();
        session
    }
}

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// One chat session: the history to send for the current turn. (Its
/// accessors serve the tests; the driver needs only the request body.)
#[derive(Debug, Clone)]
pub struct ChatSession {
    id: u64,
    app: u32,
    turns: u32,
    /// The current turn, from 1.
    turn: u32,
    user_message_tokens: u32,
    messages: Vec<Message>,
    rng: SmallRng,
}

impl ChatSession {
    #[cfg(test)]
    pub fn id(&self) -> u64 {
        self.id
    }

    #[cfg(test)]
    pub fn app(&self) -> u32 {
        self.app
    }

    /// How many turns this session has in all.
    #[cfg(test)]
    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// The current turn, from 1.
    #[cfg(test)]
    pub fn turn(&self) -> u32 {
        self.turn
    }

    /// The messages to send this turn: the system prompt, then user and
    /// assistant messages in turn, ending with the new user message.
    #[cfg(test)]
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The OpenAI chat body of this turn, streaming with the usage chunk
    /// asked for (as the OpenAI client does to count tokens: the router reads
    /// the engine's cached tokens from it), `max_tokens` bounded.
    pub fn request_body(&self, max_tokens: u32) -> serde_json::Value {
        let messages: Vec<serde_json::Value> = self
            .messages
            .iter()
            .map(|message| {
                serde_json::json!({"role": message.role.as_str(), "content": message.content})
            })
            .collect();
        serde_json::json!({
            "model": "engine-sim", "stream": true, "max_tokens": max_tokens,
            "stream_options": {"include_usage": true},
            "messages": messages,
        })
    }

    /// Ends the current turn with an answer `answer_tokens` long: appends the
    /// answer and, if the session has turns left, the next user message.
    /// Returns whether another turn follows. The answer's text is rebuilt
    /// from the seed (only its length and the history's determinism
    /// matter to a prefix cache).
    pub fn finish_turn(&mut self, answer_tokens: u32) -> bool {
        if self.turn >= self.turns {
            return false;
        }
        let head = format!("[answer {} {}]", self.id, self.turn);
        let answer = filler(&mut self.rng, &head, tokens_to_chars(answer_tokens));
        self.messages.push(Message {
            role: Role::Assistant,
            content: answer,
        });
        self.turn += 1;
        self.push_user_message();
        true
    }

    fn push_user_message(&mut self) {
        let mean = self.user_message_tokens.max(1);
        let tokens = self.rng.random_range(mean.div_ceil(2)..=mean + mean / 2);
        // The session's number first: no two sessions' histories share a
        // block past the system prompt.
        let head = format!(
            "[session {} of app {} turn {}]",
            self.id, self.app, self.turn
        );
        let chars = tokens_to_chars(tokens).max(head.len().next_multiple_of(CHARS_PER_TOKEN));
        let content = filler(&mut self.rng, &head, chars);
        self.messages.push(Message {
            role: Role::User,
            content,
        });
    }
}

/// Keeps the system prompts' generators apart from the sessions'.
const SYSTEM_SALT: u64 = 0x7379_7374_656d_0001;

const WORDS: [&str; 32] = [
    "answer", "briefly", "cite", "the", "policy", "when", "asked", "about", "orders", "refunds",
    "shipping", "never", "invent", "facts", "prefer", "tables", "for", "numbers", "and", "keep",
    "a", "polite", "tone", "escalate", "billing", "issues", "to", "staff", "check", "account",
    "status", "first",
];

fn tokens_to_chars(tokens: u32) -> usize {
    tokens as usize * CHARS_PER_TOKEN
}

/// `head`, then random words, cut to exactly `chars` ASCII characters.
fn filler(rng: &mut SmallRng, head: &str, chars: usize) -> String {
    let mut text = String::with_capacity(chars + 16);
    text.push_str(head);
    while text.len() < chars {
        text.push(' ');
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text.truncate(chars);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SessionConfig {
        SessionConfig {
            apps: 8,
            system_prompt_tokens: 2000,
            user_message_tokens: 80,
            mean_turns: 6.0,
            max_turns: 24,
            seed: 7,
        }
    }

    fn concatenated(messages: &[Message]) -> String {
        messages
            .iter()
            .map(|message| message.content.as_str())
            .collect()
    }

    #[test]
    fn sessions_of_one_app_share_its_system_prompt_and_nothing_else() {
        let config = config();
        let sessions: Vec<ChatSession> = (0..200).map(|id| config.session(id)).collect();
        for session in &sessions {
            let system = &session.messages()[0];
            assert_eq!(system.role, Role::System);
            assert_eq!(system.content, config.system_prompt(session.app()));
            assert_eq!(system.content.len(), 2000 * CHARS_PER_TOKEN);
            assert!(system.content.is_ascii());
            assert_eq!(session.messages()[1].role, Role::User);
        }
        // Every app is used, and apps' system prompts differ.
        let mut apps: Vec<u32> = sessions.iter().map(ChatSession::app).collect();
        apps.sort_unstable();
        apps.dedup();
        assert_eq!(apps, (0..8).collect::<Vec<_>>());
        assert_ne!(config.system_prompt(0), config.system_prompt(1));
        // Two sessions of one app diverge right after the system prompt.
        let app = sessions[0].app();
        let other = sessions[1..]
            .iter()
            .find(|session| session.app() == app)
            .unwrap();
        let (a, b) = (
            concatenated(sessions[0].messages()),
            concatenated(other.messages()),
        );
        let shared = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        let system_chars = 2000 * CHARS_PER_TOKEN;
        assert!(
            (system_chars..system_chars + 20).contains(&shared),
            "{shared}"
        );
    }

    #[test]
    fn each_turn_resends_the_history_plus_the_answer_and_a_new_message() {
        let config = config();
        let mut session = (0..)
            .map(|id| config.session(id))
            .find(|session| session.turns() >= 3)
            .unwrap();
        assert_eq!(session.turn(), 1);
        let before = session.messages().to_vec();
        assert!(session.finish_turn(50));
        assert_eq!(session.turn(), 2);
        let after = session.messages();
        assert_eq!(after.len(), before.len() + 2);
        assert_eq!(&after[..before.len()], &before[..]);
        let answer = &after[before.len()];
        assert_eq!(answer.role, Role::Assistant);
        assert_eq!(answer.content.len(), 50 * CHARS_PER_TOKEN);
        let user = &after[before.len() + 1];
        assert_eq!(user.role, Role::User);
        let head = format!("[session {} of app {} turn 2]", session.id(), session.app());
        assert!(user.content.starts_with(&head), "{}", user.content);
        // Between half and one and a half times the mean user message.
        assert_eq!(user.content.len() % CHARS_PER_TOKEN, 0);
        let tokens = user.content.len() / CHARS_PER_TOKEN;
        assert!((40..=120).contains(&tokens), "{tokens}");
        // The chat body carries the same history, in order, with roles.
        let body = session.request_body(64);
        let sent = body["messages"].as_array().unwrap();
        assert_eq!(sent.len(), session.messages().len());
        assert_eq!(sent[0]["role"], "system");
        assert_eq!(sent[2]["role"], "assistant");
        assert_eq!(sent[3]["content"], session.messages()[3].content.as_str());
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["max_tokens"], 64);
    }

    #[test]
    fn a_seed_replays_the_same_sessions_and_another_seed_does_not() {
        let config = config();
        let play = |config: &SessionConfig, id: u64| {
            let mut session = config.session(id);
            while session.finish_turn(30) {}
            session.messages().to_vec()
        };
        for id in 0..20 {
            assert_eq!(play(&config, id), play(&config, id));
        }
        let other = SessionConfig {
            seed: 8,
            ..config.clone()
        };
        assert!((0..20).any(|id| play(&config, id) != play(&other, id)));
    }

    #[test]
    fn session_lengths_are_geometric_within_bounds() {
        let base = config();
        let turns: Vec<u32> = (0..4000).map(|id| base.session(id).turns()).collect();
        assert!(turns.iter().all(|turns| (1..=24).contains(turns)));
        let mean = turns.iter().map(|&turns| f64::from(turns)).sum::<f64>() / turns.len() as f64;
        // Geometric with mean 6, cut at 24: 6 × (1 − (5/6)^24) ≈ 5.90.
        assert!((5.5..6.3).contains(&mean), "{mean}");
        assert!(turns.contains(&1) && turns.iter().any(|&turns| turns > 12));
        // A session ends after exactly its turns.
        let mut session = base.session(3);
        let mut played = 1;
        while session.finish_turn(10) {
            played += 1;
        }
        assert_eq!(played, session.turns());
        assert!(!session.finish_turn(10));
        // One turn at most, and a mean of one, give one-turn sessions.
        let single = SessionConfig {
            max_turns: 1,
            ..base.clone()
        };
        assert!((0..100).all(|id| single.session(id).turns() == 1));
        let one = SessionConfig {
            mean_turns: 1.0,
            ..base
        };
        assert!((0..100).all(|id| one.session(id).turns() == 1));
    }

    #[test]
    fn bad_configs_are_refused() {
        assert_eq!(config().validate(), Ok(()));
        let bad = [
            (
                SessionConfig {
                    apps: 0,
                    ..config()
                },
                SessionConfigError::NoApps,
            ),
            (
                SessionConfig {
                    mean_turns: 0.5,
                    ..config()
                },
                SessionConfigError::MeanTurns { mean_turns: 0.5 },
            ),
            (
                SessionConfig {
                    max_turns: 0,
                    ..config()
                },
                SessionConfigError::NoTurns,
            ),
            (
                SessionConfig {
                    user_message_tokens: 0,
                    ..config()
                },
                SessionConfigError::EmptyUserMessage,
            ),
        ];
        for (config, error) in bad {
            assert_eq!(config.validate(), Err(error));
        }
        let nan = SessionConfig {
            mean_turns: f64::NAN,
            ..config()
        };
        assert!(nan.validate().is_err());
    }
}
