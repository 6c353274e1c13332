//! Media in a prompt: what the HTTP side prepares from a request's bytes (an image's patches, a
//! clip's log-mel frames), the towers that turn them into soft tokens on the engine thread, and
//! what a prompt needs to hold each kind.

use crate::gemma4_audio::{AudioEncoding, AudioPrompt, Gemma4Audio};
use crate::gemma4_audio_features::AudioFeatures;
use crate::gemma4_vision::{Gemma4Vision, ImagePatches, ImagePrompt, VisionEncoding};
use crate::{DtypeChoice, MediaKind, ModelError, ModelFiles, Result};
use mlx::Array;

/// One media item as its tower takes it. Plain data: made off the engine thread.
#[derive(Debug, Clone)]
pub enum MediaInput {
    Image(ImagePatches),
    Audio(AudioFeatures),
}

impl MediaInput {
    pub fn kind(&self) -> MediaKind {
        match self {
            MediaInput::Image(_) => MediaKind::Image,
            MediaInput::Audio(_) => MediaKind::Audio,
        }
    }
}

/// A model's encoders: none, vision, audio or both.
#[derive(Default)]
pub struct Towers {
    pub vision: Option<Gemma4Vision>,
    pub audio: Option<Gemma4Audio>,
}

impl Towers {
    /// The towers among a model's files and what a prompt needs to hold their media: a tower
    /// whose processor config is missing is not loaded (the model then takes no such media).
    pub fn load(files: &ModelFiles, dtype: DtypeChoice) -> Result<(Towers, MediaPrompt)> {
        let (vision, images) = match crate::load_vision_files(files, dtype)? {
            Some((v, p)) => (Some(v), Some(p)),
            None => (None, None),
        };
        let (audio, clips) = match crate::load_audio_files(files, dtype)? {
            Some((a, p)) => (Some(a), Some(p)),
            None => (None, None),
        };
        Ok((
            Towers { vision, audio },
            MediaPrompt {
                images,
                audio: clips,
            },
        ))
    }

    /// The soft tokens of one item, `[soft_tokens, text hidden]`.
    pub fn encode(&self, input: &MediaInput) -> Result<Array> {
        self.finish(self.begin(input)?)
    }

    fn vision(&self) -> Result<&Gemma4Vision> {
        self.vision
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("an image without a vision tower".into()))
    }

    fn audio(&self) -> Result<&Gemma4Audio> {
        self.audio
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("audio without an audio tower".into()))
    }

    /// An item's encoding begun (its input embedded, nothing evaluated): the engine runs a
    /// tower a layer at a time ([`Towers::advance`]) so that a long encoding shares the steps
    /// with other sequences' work rather than stalling them.
    pub fn begin(&self, input: &MediaInput) -> Result<Encoding> {
        Ok(match input {
            MediaInput::Image(p) => Encoding::Image(self.vision()?.begin(p)?),
            MediaInput::Audio(f) => Encoding::Audio(self.audio()?.begin(f)?),
        })
    }

    /// Runs the next layer of `e` and evaluates it; `false` (and nothing run) once every layer
    /// has run.
    pub fn advance(&self, e: &mut Encoding) -> Result<bool> {
        let (ran, state) = match e {
            Encoding::Image(v) => {
                let ran = self.vision()?.advance(v)?;
                (ran, Gemma4Vision::state(v))
            }
            Encoding::Audio(a) => {
                let ran = self.audio()?.advance(a)?;
                (ran, Gemma4Audio::state(a))
            }
        };
        if ran {
            state.eval()?;
        }
        Ok(ran)
    }

    /// The soft tokens of an encoding, its remaining layers run first.
    pub fn finish(&self, e: Encoding) -> Result<Array> {
        match e {
            Encoding::Image(v) => self.vision()?.finish(v),
            Encoding::Audio(a) => self.audio()?.finish(a),
        }
    }

    /// Whether the model takes media of this kind.
    pub fn takes(&self, kind: MediaKind) -> bool {
        match kind {
            MediaKind::Image => self.vision.is_some(),
            MediaKind::Audio => self.audio.is_some(),
        }
    }
}

/// One item's encoding part-way through its tower.
pub enum Encoding {
    Image(VisionEncoding),
    Audio(AudioEncoding),
}

/// What the HTTP side needs to put media into a prompt, per kind the model takes. Plain data.
#[derive(Debug, Clone, Default)]
pub struct MediaPrompt {
    pub images: Option<ImagePrompt>,
    pub audio: Option<AudioPrompt>,
}

impl MediaPrompt {
    /// Whether the model takes any media.
    pub fn any(&self) -> bool {
        self.images.is_some() || self.audio.is_some()
    }
}
